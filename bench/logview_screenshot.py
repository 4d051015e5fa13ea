"""A screenshot of one episode of a run in the log viewer, as a tutorial shows it.

    python bench/logview_screenshot.py RUN_FOLDER OUT.png [--split val] [--step N] [--success] [--mode mask]

Serves RUN_FOLDER's parent with the log viewer, picks the first episode of `--split` at `--step` (default: the
run's last step of that split; `--success`: the first successful one), opens its page in headless Chromium
(Debian's chromium and chromium-driver, as the tests use), sets the token colouring (`--mode`: mask shows what was
trained, logprob, diff) and saves the page.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import urllib.request
from pathlib import Path


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--split", default="val")
    ap.add_argument("--step", type=int)
    ap.add_argument("--success", action="store_true")
    ap.add_argument("--mode", default="mask", choices=["mask", "logprob", "diff"])
    ap.add_argument("--height", type=int, default=1400)
    args = ap.parse_args()
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not (chromium and driver):
        sys.exit("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from astuner.logview.app import LogViewServer

    run = args.run.resolve()
    server = LogViewServer(run.parent)
    url = server.start()
    try:
        steps = [s["step"] for s in get(f"{url}api/runs/{run.name}/steps")["steps"] if s["split"] == args.split]
        if not steps:
            sys.exit(f"no {args.split} episodes in {run}")
        step = args.step if args.step is not None else max(steps)
        items = get(f"{url}api/runs/{run.name}/episodes?split={args.split}&step={step}&page_size=100")["items"]
        chosen = [e for e in items if e["success"]] if args.success else items
        if not chosen:
            sys.exit(f"no {'successful ' if args.success else ''}{args.split} episode at step {step}")
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    f"--window-size=1400,{args.height}"):
            options.add_argument(arg)
        browser = webdriver.Chrome(service=Service(driver), options=options)
        try:
            browser.get(f"{url}#/run/{run.name}/episode/{chosen[0]['id']}")
            wait = WebDriverWait(browser, 30)
            wait.until(EC.presence_of_all_elements_located((By.CSS_SELECTOR, "#token-view .tok")))
            Select(browser.find_element(By.ID, "color-mode")).select_by_value(args.mode)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(args.out))
        finally:
            browser.quit()
    finally:
        server.stop()
    print(f"{args.out}: {args.split} step {step}, episode {chosen[0]['id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
