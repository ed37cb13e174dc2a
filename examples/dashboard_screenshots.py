"""Screenshots of a podmonitor run in the real TensorBoard, taken with headless Chromium.

Usage (from the repository root, after ``make demo``)::

    python examples/dashboard_screenshots.py --logdir runs/gpt_tiny --out docs/screenshots

It starts ``tensorboard --logdir <logdir>`` on 127.0.0.1 (a free port), waits until the server
has loaded the podmonitor tags (HTTP data API), and saves three PNGs with ``chromium --headless``:

- ``scalars_t_spec.png``: the Scalars tab filtered on one headline metric
  (``pod/headline/t_spec``: every layer a line of its own colour, the runs list as legend; the
  Time Series tab shows the same cards, but draws their lines with WebGL, which headless Chromium
  without a GPU leaves blank);
- ``custom_scalars.png``: the Custom Scalars tab (the headline page of the layout);
- ``images.png``: the Images tab (the scale-organisation heatmap and the per-layer pictures).

Needs the Debian package ``chromium`` (``apt-get install chromium``). Nothing leaves the machine:
the server listens on loopback only and the browser opens only that address.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PAGES = {
    # the Scalars tab: the Time Series tab draws its lines with WebGL, which headless Chromium
    # without a GPU leaves blank (the cards and legends render, the lines do not)
    "scalars_t_spec.png": "/#scalars&tagFilter=pod%2Fheadline%2Ft_spec",
    "custom_scalars.png": "/#custom_scalars",
    "images.png": "/#images&tagFilter=pod%2F(scale_organisation%7Ctrend%2Ft_spec%7Cspectrum%7Cmodes)",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback only
        return json.loads(resp.read())


def wait_for_tags(base: str, seconds: float = 120.0) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            tags = get_json(f"{base}/data/plugin/scalars/tags")
            if any("pod/headline/t_spec" in t for t in tags.values()):  # type: ignore[union-attr]
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"TensorBoard at {base} did not serve the podmonitor tags within {seconds:.0f} s")


def screenshot(browser: str, url: str, out: Path, size: str, budget_ms: int) -> None:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={size}", f"--virtual-time-budget={budget_ms}",
               f"--screenshot={out}", url]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=180)
    if not out.exists() or out.stat().st_size == 0:
        raise SystemExit(f"chromium wrote no screenshot for {url}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--logdir", default="runs/gpt_tiny")
    ap.add_argument("--out", default="docs/screenshots")
    ap.add_argument("--size", default="1400,1000", help="browser window, width,height in pixels")
    ap.add_argument("--budget-ms", type=int, default=20000, help="virtual time the page gets to render")
    args = ap.parse_args(argv)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium not found: apt-get install chromium")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", args.logdir, "--host",
                               "127.0.0.1", "--port", str(port), "--reload_interval", "5"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_tags(base)
        for name, path in PAGES.items():
            screenshot(browser, base + path, out / name, args.size, args.budget_ms)
            print(f"wrote {out / name}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
