"""The HTTP side of remote agents: the board's routes (`/astuner/v1/...`) and, on the same port, the run's OpenAI
and Anthropic endpoints (`/v1/...`, the episodes' own keys) for the agents' model calls.

    POST /astuner/v1/episodes/next          {"wait_s": <= 30, "take_token": "..."}  ->  {"episode": {...} | null,
                                            "run_over": bool}; a take sent again with its token gets the same episode
    POST /astuner/v1/episodes/{id}/result   {"reward", "is_success", "metadata", "metrics", "agent_rewards",
                                             "response"}  ->  {"ok": true}; 410 once the episode is over
    POST /astuner/v1/episodes/{id}/error    {"error": "..."}  ->  the episode is flagged failed
    GET  /astuner/v1/status                 the board's counts

A client is its key's name (`astuner serve-key`; any `tml-` key on loopback without keys) plus its
`X-Astuner-Client` header, so several processes may share a key; only the client that took an episode may end it.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from astuner.http_body import HttpError, read_json
from astuner.serve.remote_board import BoardError, EpisodeBoard, RemoteAgentError, workflow_output

MAX_BODY = 8 << 20
MAX_WAIT_S = 30.0


class RemoteApp:
    def __init__(self, board: EpisodeBoard, keys):
        self.board, self.keys = board, keys
        self.routes = Starlette(routes=[
            Route("/astuner/v1/episodes/next", self._endpoint(self.next_episode), methods=["POST"]),
            Route("/astuner/v1/episodes/{episode_id}/result", self._endpoint(self.result), methods=["POST"]),
            Route("/astuner/v1/episodes/{episode_id}/error", self._endpoint(self.error), methods=["POST"]),
            Route("/astuner/v1/status", self._endpoint(self.status), methods=["GET"]),
            Route("/astuner/{path:path}", self._endpoint(self.unknown), methods=["GET", "POST", "PUT", "DELETE"]),
        ])

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/astuner/"):
            return await self.routes(scope, receive, send)
        gateway = self.board.gateway
        if gateway is None:  # the model endpoints exist once the run's first episode was offered
            response = JSONResponse({"error": {"message": "no episode has started yet; take one from "
                                               "/astuner/v1/episodes/next first", "type": "unavailable"}},
                                    status_code=503)
            return await response(scope, receive, send)
        await gateway.app(scope, receive, send)

    def _endpoint(self, fn):
        async def handle(request: Request) -> JSONResponse:
            client = self._client(request)
            if client is None:
                return JSONResponse({"detail": "a valid astuner serve key is needed in X-API-Key or Authorization"},
                                    status_code=401)
            try:
                return JSONResponse(await fn(request, client))
            except HttpError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=exc.status)

        return handle

    def _client(self, request: Request) -> str | None:
        name = request.headers.get("x-astuner-client", "client")[:100]
        if self.keys.open_access():
            return f"local/{name}"
        auth = request.headers.get("authorization", "")
        key = request.headers.get("x-api-key") or (auth[7:] if auth.lower().startswith("bearer ") else None)
        owner = self.keys.owner(key)
        return None if owner is None else f"{owner}/{name}"

    @staticmethod
    async def _json(request: Request) -> dict:
        return await read_json(request, MAX_BODY)

    async def next_episode(self, request: Request, client: str) -> dict:
        body = await self._json(request)
        wait, token = body.get("wait_s", 20.0), body.get("take_token")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_S:
            raise BoardError(400, f"wait_s must be a number of seconds in 0..{MAX_WAIT_S:g}")
        if token is not None and (not isinstance(token, str) or not 0 < len(token) <= 128):
            raise BoardError(400, "take_token must be a string of 1..128 characters")
        episode = await self.board.wait_take(client, float(wait), token)
        return {"episode": episode, "run_over": self.board.run_over and episode is None}

    async def result(self, request: Request, client: str) -> dict:
        output = workflow_output(await self._json(request))
        output.metadata.setdefault("remote_client", client)  # who ran it, in the trajectories and the log viewer
        self.board.finish(request.path_params["episode_id"], client, output)
        return {"ok": True}

    async def error(self, request: Request, client: str) -> dict:
        message = (await self._json(request)).get("error")
        if not isinstance(message, str) or not message:
            raise BoardError(400, "error must be a non-empty string (what went wrong in the agent)")
        self.board.finish(request.path_params["episode_id"], client,
                          RemoteAgentError(f"the remote agent ({client}) failed: {message[:2000]}"))
        return {"ok": True}

    async def status(self, request: Request, client: str) -> dict:
        return self.board.counts()

    async def unknown(self, request: Request, client: str) -> dict:
        raise BoardError(404, f"astuner serve has no endpoint {request.method} {request.url.path}")
