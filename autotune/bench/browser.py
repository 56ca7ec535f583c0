"""Debian's headless chromium, driven through its chromedriver (selenium): the dashboard's test and benchmark."""

from __future__ import annotations

import shutil

# No sandbox (we run as root here), no GPU, and none of the background traffic a closed network refuses.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1400,1300")


def available() -> bool:
    return bool(shutil.which("chromium") and shutil.which("chromedriver"))


def headless_chromium():
    """A selenium driver of a fresh headless chromium that keeps the page's console log."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
