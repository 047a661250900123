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
    # wait for this call to finish: the page's own call at load may still be refilling the menu otherwise
    browser.set_script_timeout(30)
    browser.execute_async_script("showModel().then(arguments[arguments.length - 1])")
    assert len(Select(browser.find_element(By.ID, "language")).options) == 2
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


def test_page_before_the_key_lists_no_languages_and_says_why(browser, srv) -> None:
    browser.execute_script("localStorage.clear()")
    browser.get(srv.url + "/")
    WebDriverWait(browser, 10).until(lambda d: "API key" in d.find_element(By.ID, "status").text)
    # no guessed list: only "detect" until /v1/models (which needs the key) names the model's own languages
    assert [o.text for o in Select(browser.find_element(By.ID, "language")).options] == ["detect"]
    open_page(browser, srv)  # typing the key fills the menu: only English for the demo model
    menu = Select(browser.find_element(By.ID, "language"))
    assert [o.get_attribute("value") for o in menu.options] == ["", "English"]
    assert not browser.find_element(By.ID, "status").text  # the hint is gone once the key works


def test_page_shows_errors_in_the_error_colour(browser, srv) -> None:
    open_page(browser, srv)
    browser.execute_script("document.getElementById('file').value = ''; recorded = null;")
    browser.find_element(By.ID, "go").click()  # no file chosen: an error
    status = browser.find_element(By.ID, "status")
    assert status.text == "Choose a file or record first." and status.get_attribute("class") == "error"
    assert status.value_of_css_property("color") in ("rgba(176, 0, 32, 1)", "rgb(176, 0, 32)")
    browser.execute_script("setStatus('fine', false)")
    assert status.value_of_css_property("color") in ("rgba(102, 102, 102, 1)", "rgb(102, 102, 102)")


def test_page_puts_each_finished_caption_turn_on_its_own_line(browser, srv) -> None:
    open_page(browser, srv)
    browser.execute_script("document.getElementById('captions').hidden = false;"
                           "document.getElementById('finals').textContent = '';"
                           "onLiveMessage({type: 'final', text: 'set an alarm'});"
                           "onLiveMessage({type: 'final', text: ''});"
                           "onLiveMessage({type: 'final', text: 'call anna'});")
    assert browser.find_element(By.ID, "finals").text.splitlines() == ["set an alarm", "call anna"]


def test_favicon_is_open_and_an_image(srv) -> None:
    import httpx

    icon = httpx.get(srv.url + "/favicon.ico", timeout=10)  # no key: browsers never send one here
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
    assert icon.text.startswith("<svg")
    assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401  # the rest still needs the key
