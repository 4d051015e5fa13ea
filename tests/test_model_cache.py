"""The demo model's first-use conversion: two runs starting together on a fresh machine convert it once, and the
second loads the first one's folder (the converter replaces the folder, which would pull it from under a reader)."""

from __future__ import annotations

import threading
import time

from astuner import model_cache


def test_two_first_uses_at_once_convert_the_demo_model_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTUNER_CACHE", str(tmp_path))
    calls = []

    def fake_convert(gguf_dir, gguf_name, target):
        calls.append(target)
        time.sleep(0.5)  # long enough for the other first use to arrive while this one converts
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(model_cache, "_convert_gguf", fake_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(model_cache.ensure_demo_model("smollm2-135m-instruct")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1] == tmp_path / "models" / "smollm2-135m-instruct"
