#!/usr/bin/env bash
# Install Debian's headless Chromium and its WebDriver, which tests/test_labeling_browser.py drives (the
# labelling page of `flowrl label`). Run by `make install`, so CI (root on Debian) runs that test.
#   - both already installed      -> nothing to do.
#   - root with apt-get           -> apt-get install chromium chromium-driver (idempotent: apt keeps what is there).
#   - otherwise                   -> says so and installs nothing; the browser test then skips (outside CI) with
#                                    the same reason. A failing apt-get fails the install: CI must not lose the test quietly.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  echo "install_browser: chromium and chromedriver already installed"
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "install_browser: not root, so chromium and chromium-driver were not installed; the labelling page's browser test will be" \
       "skipped (install them yourself: sudo apt-get install chromium chromium-driver)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: no apt-get on this machine, so chromium and chromium-driver were not installed; the labelling page's" \
       "browser test will be skipped (install Chromium and a matching chromedriver on the PATH to run it)"
  exit 0
fi
echo "install_browser: installing chromium and chromium-driver with apt-get"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium chromium-driver
