"""The agent quick-start's agent as a process of its own: it takes episodes from `astuner serve` and runs them.

    python tutorial/remote_agent/agent_client.py --url http://127.0.0.1:8000 [--key tml-...] [--concurrency 16]

The agent is the quick-start's `answer()` (tutorial/agent_quickstart/lookup_agent.py), unchanged, on an
`openai.AsyncOpenAI` pointed at the server with the episode's key; the tools run here, in this process. It posts
the final answer for the run's judge (CodeJudge, on the server) to score. This file needs no torch and no astuner:
only the light client (`pip install ./clients/remote`: astuner_remote, httpx, openai).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent_quickstart"))

from lookup_agent import answer  # noqa: E402 (the quick-start's agent, beside this tutorial)

from astuner_remote import RemoteClient  # noqa: E402


async def run_episode(episode):
    final = await answer(episode.openai_client(), episode.task["query"])
    return {"metadata": {"final_answer": final}}  # no reward: the run's judge scores it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", default=None, help="this client's key (astuner serve-key create NAME); default: "
                        "$ASTUNER_API_KEY, or any key on a loopback server without keys")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes run at once")
    parser.add_argument("--idle-exit", type=float, default=120.0,
                        help="stop after this many seconds without an episode (the run is over)")
    args = parser.parse_args()
    done = RemoteClient(args.url, args.key).run(run_episode, concurrency=args.concurrency, idle_exit_s=args.idle_exit)
    print(f"agent_client: {done} episodes run", file=sys.stderr)


if __name__ == "__main__":
    main()
