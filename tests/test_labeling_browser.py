"""The labelling page in a real headless Chromium (Debian's chromium + chromium-driver, installed by
`make install`): label by click and by key, undo by click and by key, reload, a second tab on the same
pair; then labels.jsonl holds exactly those clicks, a restart continues after them, and D3PO and
Diffusion-DPO train from them (one real iteration each on the embedded digits model)."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from labeling_support import D3PO, DPO, LabelServer, call, records, shared_pairs

from flowrl.preferences.labels import left_slot, preferred_slot
from flowrl.preferences.pairs import read_pairs

CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not (CHROMIUM and DRIVER):
        message = "needs Debian's chromium and chromium-driver (make install installs them with apt-get when run as root)"
        if os.environ.get("CI"):
            pytest.fail(message + ", and CI must run this test")
        pytest.skip(message)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must use the driver it is given, never download one
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.mark.slow
def test_label_in_chromium_then_d3po_and_diffusion_dpo_train_from_the_clicks(browser, tmp_path_factory, tmp_path, capfd):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    directory = shared_pairs(tmp_path_factory, tmp_path / "pairs")
    prompts = read_pairs(directory).prompts

    def shows(pair, labelled: int):
        WebDriverWait(browser, 15).until(
            lambda d: (
                d.find_element(By.TAG_NAME, "body").get_attribute("data-pair") == str(pair)
                and d.find_element(By.ID, "progress").text.startswith(f"{labelled} / 6 labelled")
            )
        )

    def image_widths() -> list[int]:
        # the <img> elements load after data-pair changes; wait until both have finished (complete), so a slow
        # image is not read as width 0
        script = "return ['left', 'right'].map(id => document.getElementById(id))"
        WebDriverWait(browser, 15).until(lambda d: d.execute_script(script + ".every(img => img.complete)"))
        return browser.execute_script(script + ".map(img => img.naturalWidth)")

    def click(button: str):
        browser.find_element(By.ID, f"btn-{button}").click()

    def key(k: str):
        ActionChains(browser).send_keys(k).perform()

    with LabelServer(directory) as server:
        browser.get(server.url)
        shows(0, 0)
        assert browser.find_element(By.ID, "prompt").text.startswith(f"“{prompts[0]}”")
        assert image_widths() == [8, 8]  # both 8x8 digit images arrived
        assert browser.find_element(By.ID, "left").get_attribute("src").endswith(f"/image/0/{left_slot(0)}.png")
        click("left")  # pair 0 by click
        shows(1, 1)
        key(Keys.ARROW_RIGHT)  # pair 1 by key
        shows(2, 2)
        key("t")  # pair 2: tie
        shows(3, 3)
        click("undo")  # withdraws pair 2's tie
        shows(2, 2)
        assert browser.find_element(By.ID, "message").text == "undid pair 2's label"
        key("u")  # and pair 1's right
        shows(1, 1)
        key("1")  # pair 1 again, now left
        shows(2, 2)
        key("s")  # pair 2 skipped
        shows(3, 3)
        browser.refresh()  # a reload starts from the server's state: pair 3, nothing lost
        shows(3, 3)
        assert "2 preferences, 0 ties, 1 skips" in browser.find_element(By.ID, "progress").text
        first_tab = browser.current_window_handle
        browser.switch_to.new_window("tab")  # a second tab on the same pair
        browser.get(server.url)
        shows(3, 3)
        click("right")
        shows(4, 4)
        browser.switch_to.window(first_tab)  # still showing pair 3
        click("left")
        shows(4, 4)
        message = browser.find_element(By.ID, "message")
        assert message.get_attribute("class") == "error"
        assert message.text == (
            "pair 3 was already labelled 'right' (in another tab or window); nothing was saved, and this page "
            "now shows the next unlabelled pair."
        )
        assert browser.save_screenshot(str(tmp_path / "labeling.png"))
    assert (tmp_path / "labeling.png").stat().st_size > 10_000

    # labels.jsonl: every click in order, each a whole line, the undos as records of their own
    rows = records(directory)
    assert [(r.get("pair"), r.get("choice"), r.get("undo")) for r in rows] == [
        (0, "left", None),
        (1, "right", None),
        (2, "tie", None),
        (None, None, 2),
        (None, None, 1),
        (1, "left", None),
        (2, "skip", None),
        (3, "right", None),
    ]
    assert [r["seq"] for r in rows] == list(range(8)) and (directory / "labels.jsonl").read_text().endswith("\n")
    assert all(r["preferred"] == preferred_slot(r["pair"], r["choice"]) for r in rows if "pair" in r)

    # a restart continues at the first unlabelled pair; here with a token, which the page passes on
    with LabelServer(directory, env={"FLOWRL_LABEL_TOKEN": "a-token-for-the-page"}) as server:
        assert "4 of 6 pairs" in server.first_line and server.url.endswith("/?token=a-token-for-the-page")
        assert call(server.base + "api/state")[0] == 401
        browser.get(server.url)
        shows(4, 4)
        assert image_widths() == [8, 8]

    # training reads the three decisive labels (pairs 0, 1, 3), the preferred sample first
    from conftest import fast_overrides

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    stored = read_pairs(directory)
    chosen = {p: preferred_slot(p, c) for p, c in [(0, "left"), (1, "left"), (3, "right")]}
    first = [stored.winners[p] if s == "winner" else stored.losers[p] for p, s in chosen.items()]
    second = [stored.losers[p] if s == "winner" else stored.winners[p] for p, s in chosen.items()]
    common = {
        "prompts.pairs": str(directory),
        "objective.preference": "human",
        "train.iterations": 1,
        "train.prompts_per_iteration": 2,
        "train.batch_size": 4,
        "train.learning_rate": 1e-3,
    }
    for config, name in [(D3PO, "d3po"), (DPO, "diffusion_dpo")]:
        trainer = Trainer(load_config(config, fast_overrides(tmp_path / name, **common)))
        assert trainer.objective.trains_on == "offline_pairs"
        assert "training on 3 human preferences of the 6 pairs" in capfd.readouterr().err
        batch = trainer.collect(0)
        assert batch.latents.shape[1] == (5 if name == "d3po" else 1)  # D3PO: the 4-step trajectories as recorded
        for row in range(len(batch)):
            final = batch.latents[row, -1].cpu()
            assert any(final.equal(x) for x in (first if row % 2 == 0 else second))
        before = [p.detach().clone() for p in trainer.pipeline.trainable_parameters()]
        metrics = trainer.train_iteration(0)
        assert metrics["loss/policy"] == pytest.approx(math.log(2), abs=1e-5)  # the first loss of any DPO: ratio 1
        assert metrics["train/grad_norm"] > 0
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.pipeline.trainable_parameters()))
