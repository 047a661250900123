"""The web page in a real headless browser (Debian chromium + chromedriver, Selenium): upload a clip, watch
the streamed transcript arrive. Skipped where no browser is installed."""

from __future__ import annotations

import shutil

import pytest
from server_proc import ServerProcess

from qasr.testing.speech import speak

webdriver = pytest.importorskip("selenium.webdriver")
if not (shutil.which("chromium") and shutil.which("chromedriver")):
    pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

KEY = "page-key"


def open_chromium(*flags: str) -> webdriver.Chrome:
    """Headless Chromium under chromedriver; ``flags`` are extra command-line switches (e.g. a fake microphone)."""
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", *flags):
        options.add_argument(flag)
    return webdriver.Chrome(service=webdriver.ChromeService(shutil.which("chromedriver")), options=options)


@pytest.fixture(scope="module")
def browser():
    driver = open_chromium()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("page") / "serve.log", api_key=KEY)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def open_page(browser: webdriver.Chrome, srv: ServerProcess) -> None:
    """Load the page, give it the API key and pick English (the only language of the demo model)."""
    browser.get(srv.url + "/")
    key = browser.find_element(By.ID, "apikey")
    key.clear()  # the page remembers the last key (localStorage)
    key.send_keys(KEY)
    # the language menu is refilled from /v1/models (which needs the key): only English for the demo model
    browser.execute_script("showModel()")
    WebDriverWait(browser, 30).until(lambda d: len(Select(d.find_element(By.ID, "language")).options) == 2)
    Select(browser.find_element(By.ID, "language")).select_by_value("English")


def transcribe_on_page(browser: webdriver.Chrome, timeout: float = 30) -> str:
    """Click Transcribe, wait for the request to end, insist it succeeded; the transcript box's text."""
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, timeout).until(
        lambda d: d.find_element(By.ID, "status").text.startswith(("Done", "4", "5", "Request")))
    assert browser.find_element(By.ID, "status").text.startswith("Done"), browser.find_element(By.ID, "status").text
    return browser.find_element(By.ID, "transcript").text


@pytest.mark.parametrize("fmt", ["stream", "verbose_json"])
def test_page_uploads_and_shows_the_transcript(tmp_path, browser, srv, fmt) -> None:
    clip = speak("call anna on the ninth of july", tmp_path / "clip.wav")
    open_page(browser, srv)
    browser.find_element(By.ID, "file").send_keys(str(clip))
    Select(browser.find_element(By.ID, "format")).select_by_value(fmt)
    shown = transcribe_on_page(browser)
    if fmt == "stream":
        assert shown == "call anna on the ninth of july"
    else:
        assert '"text": "call anna on the ninth of july"' in shown and '"segments"' in shown
