"""`areal-kit view` in a real browser: headless Chromium (Debian's chromium and chromium-driver,
driven by selenium) against the page of a real tiny run.

A 3-step `areal-kit train tiny` run (every step's samples dumped) is served by `areal-kit view`;
the test checks that the trend shows its steps, that picking a step on a curve opens its groups,
that a sample's tokens carry their colours and loss mask, and that a step the run writes after the
page opened (metrics row and samples, through RunLogger as the run writes them) appears without a
reload. It saves a screenshot of each view to docs/img/view-*.png (the README shows them).
About 60 s on CI's 2-core machine: ~30 s of training, ~15 s of browser.

    .venv/bin/python -m pytest tests/integration/test_view_browser.py -s
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from areal_kit import runlog

selenium = pytest.importorskip("selenium")
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
STEPS = 3

pytestmark = pytest.mark.skipif(not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)),
                                reason="needs Debian's chromium and chromium-driver (.ci/install.sh --test)")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("view")
    exe = Path(sys.executable).with_name("areal-kit")
    proc = subprocess.run([str(exe), "train", "tiny", f"exp_ctrl.total_train_steps={STEPS}",
                           "exp_ctrl.dump_samples_every=1", "exp_ctrl.dump_samples_groups=4", "tensorboard=false"],
                          cwd=tmp, capture_output=True, text=True, env={**os.environ, "AREAL_USER": "ci"},
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return tmp / "areal_runs" / "logs" / "ci" / "tiny" / "run0"


@pytest.fixture()
def page(run_dir):
    exe = Path(sys.executable).with_name("areal-kit")
    server = subprocess.Popen([str(exe), "view", str(run_dir), "--port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    url = re.search(r"(http://\S+/)", line)
    assert url, line + server.stderr.read()
    profile = tempfile.mkdtemp(prefix="chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}", "--window-size=1400,1000"):
        opts.add_argument(a)
    driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
    try:
        driver.get(url[1])
        yield driver
    finally:
        driver.quit()
        server.terminate()
        server.wait(10)
        shutil.rmtree(profile, ignore_errors=True)


def js(d, expr: str):
    return d.execute_script(f"return {expr};")


def until(d, expr: str, timeout: float = 15):
    """Wait until the JavaScript expression is truthy; its value."""
    return WebDriverWait(d, timeout, poll_frequency=0.1).until(lambda d: js(d, expr))


def shot(d, name: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    d.save_screenshot(str(IMG / f"view-{name}.png"))


def test_view_from_trend_to_token_live(page, run_dir):
    d, t0 = page, time.time()
    # The trend: every step of the run, on every panel the run logged.
    steps = until(d, "window.__view.trend && window.__view.trend.steps.length && window.__view.trend.steps")
    assert steps == list(range(1, STEPS + 1))
    assert f"{STEPS} steps" in d.find_element(By.ID, "run-steps").text
    panels = d.find_elements(By.CSS_SELECTOR, "#trend .panel .uplot")
    assert len(panels) >= 7  # reward, KL, entropy, length, no-eos, zero-advantage, staleness, step time
    # It opens on the latest step's groups, each prompt's answers sorted by reward.
    until(d, f"window.__view.stepData && window.__view.stepData.step === {STEPS}")
    groups = d.find_elements(By.CSS_SELECTOR, "#step-view .group")
    assert len(groups) == 4
    for g in js(d, "window.__view.stepData.groups"):
        rewards = [s["task_reward"] for s in g["samples"]]
        assert rewards == sorted(rewards, reverse=True) and len(rewards) == 8
    shot(d, "trend")

    # Picking step 1 on the task_reward curve opens it.
    over = d.find_element(By.CSS_SELECTOR, "#trend .panel .u-over")
    ActionChains(d).move_to_element_with_offset(over, -over.size["width"] // 2 + 2, 0).click().perform()
    until(d, "window.__view.stepData && window.__view.stepData.step === 1")
    assert not d.find_element(By.ID, "follow").is_selected()
    assert len(d.find_elements(By.CSS_SELECTOR, "#step-view tr.sample")) == 32
    d.find_element(By.ID, "f-fail").click()  # only failures: no answer with a reward left
    shown = [float(e.text) for e in d.find_elements(By.CSS_SELECTOR, "#step-view tr.sample td.num:nth-child(2)")]
    assert all(r <= 0 for r in shown)
    d.find_element(By.ID, "f-fail").click()
    # The same prompts' answers at another step, side by side (or a line saying the prompt is not there).
    d.execute_script("const c = document.getElementById('compare-select'); c.value = '2'; "
                     "c.dispatchEvent(new Event('change'))")
    until(d, "document.querySelectorAll('#step-view .pair .side.compare[data-step=\"2\"]').length === 4")
    d.execute_script("const c = document.getElementById('compare-select'); c.value = ''; "
                     "c.dispatchEvent(new Event('change'))")
    d.execute_script("document.getElementById('step-select').scrollIntoView()")
    shot(d, "step")

    # A sample, token by token: coloured by its sampling logprob, its loss mask on each token.
    d.find_element(By.CSS_SELECTOR, "#step-view tr.sample").click()
    until(d, "!document.getElementById('tab-sample').hidden && document.querySelectorAll('#sample-tokens .tok').length")
    sample = js(d, "window.__view.sample")
    toks = d.find_elements(By.CSS_SELECTOR, "#sample-tokens .tok")
    assert [t.text for t in toks] == [t.strip() or t for t in sample["tokens"]]
    colours = {t.value_of_css_property("background-color") for t in toks}
    assert all(c not in ("rgba(0, 0, 0, 0)", "transparent") for c in colours)
    assert {t.get_attribute("data-mask") for t in toks} == {"1"}  # a single-turn answer: every token trained on
    shot(d, "sample")
    # The trainer's fields are offered too; coloured by the ratio, each token carries its own.
    offered = [o.get_attribute("value") for o in d.find_elements(By.CSS_SELECTOR, "#color-by option")]
    assert {"logprobs", "trainer_logprob", "ratio", "ref_kl", "entropy"} <= set(offered)
    d.execute_script("const c = document.getElementById('color-by'); c.value = 'ratio'; "
                     "c.dispatchEvent(new Event('change'))")
    until(d, "document.getElementById('legend').textContent.includes('ratio')")
    values = [float(t.get_attribute("data-value")) for t in d.find_elements(By.CSS_SELECTOR, "#sample-tokens .tok")]
    assert values == sample["ratio"]
    d.execute_script("const c = document.getElementById('color-by'); c.value = 'logprobs'; "
                     "c.dispatchEvent(new Event('change'))")

    # A step written after the page opened appears without a reload: the run's own writers.
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["global_step"] == STEPS]
    metrics = runlog.read_metrics(str(run_dir / "metrics.jsonl"))[-1]
    paths = runlog.RunPaths(str(run_dir), "", "")
    log = runlog.RunLogger(paths, tensorboard=False, console=False)
    new = []
    for r in last:
        r = {k: v for k, v in r.items() if k != "global_step"}
        n = len(r["tokens"])
        r["loss_mask"] = [1] + [0] * (n - 1)  # as an agent's tool turn: context, not trained on
        new.append(r)
    log.step(STEPS + 1, {k: v for k, v in metrics.items() if k not in ("global_step", "time")})
    log.samples(STEPS + 1, new)
    log.close()
    until(d, f"window.__view.trend.steps.length === {STEPS + 1}", timeout=10)
    assert d.find_element(By.CSS_SELECTOR, f"#step-select option[value='{STEPS + 1}']")
    d.find_element(By.CSS_SELECTOR, 'nav button[data-tab="main"]').click()
    d.find_element(By.ID, "follow").click()  # follow the latest again
    until(d, f"window.__view.stepData.step === {STEPS + 1}", timeout=10)
    d.find_element(By.CSS_SELECTOR, "#step-view tr.sample").click()
    until(d, f"window.__view.sample && window.__view.sample.__step === {STEPS + 1}")
    until(d, "document.querySelectorAll('#sample-tokens .tok.ctx').length")
    masks = [t.get_attribute("data-mask") for t in d.find_elements(By.CSS_SELECTOR, "#sample-tokens .tok")]
    assert masks[0] == "1" and set(masks[1:]) == {"0"}

    # Time and run views.
    d.find_element(By.CSS_SELECTOR, 'nav button[data-tab="time"]').click()
    until(d, "document.querySelectorAll('#lanes .lane').length")
    d.find_element(By.ID, "slowest").click()  # a step the run trained: its lanes per process, as it recorded them
    until(d, "document.getElementById('lanes').dataset.kind === 'spans'")
    lanes = [e.get_attribute("data-lane") for e in d.find_elements(By.CSS_SELECTOR, "#lanes .lane")]
    assert lanes[:2] == ["driver", "trainer"] and "engine 0" in lanes
    whats = {e.get_attribute("data-what") for e in d.find_elements(By.CSS_SELECTOR, "#lanes .seg")}
    assert {"wait for the rollout", "generate", "train step", "weight sync"} <= whats
    shot(d, "time")
    d.find_element(By.CSS_SELECTOR, 'nav button[data-tab="run"]').click()
    until(d, "document.querySelectorAll('#config tr').length > 50")
    assert "tiny/run0" in d.find_element(By.ID, "run-summary").text
    kinds = [e.get_attribute("data-kind") for e in d.find_elements(By.CSS_SELECTOR, "#events tr.ev")]
    assert kinds[0] == "launch" and "finished" in kinds
    assert d.find_element(By.CSS_SELECTOR, '#config tr[data-source="override"]')
    shot(d, "run")
    print(f"\nbrowser part: {time.time() - t0:.1f}s")


def test_each_dumped_answer_carries_what_the_trainer_computed_for_its_tokens(run_dir):
    """The run's own samples.jsonl: beside each output token's sampling logprob, the trainer's
    logprob (before the step's update), the ratio of the two, the reference KL (tiny has a reference
    model) and the entropy, one value per token, from the step that trained on them. The first
    step is on-policy (vLLM and the trainer hold the same weights): the ratio is ~1 and the
    reference, the initial model, is the policy itself, so the KL is ~0."""
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["global_step"] <= STEPS]
    assert {r["global_step"] for r in rows} == set(range(1, STEPS + 1))
    first = []
    for r in rows:
        n = r["n_tokens"]
        for k in ("tokens", "logprobs", "trainer_logprob", "ratio", "ref_kl", "entropy"):
            assert len(r[k]) == n, (k, r)
        for lp, b, ratio in zip(r["trainer_logprob"], r["logprobs"], r["ratio"]):
            assert ratio == pytest.approx(math.exp(lp - b), rel=3e-4, abs=1e-4)  # both logprobs at 4 decimals
        assert all(e >= 0 for e in r["entropy"])
        if r["global_step"] == 1:
            assert r["version"] == 0
            first.append(r)
    assert len(first) == 32
    ratios = [x for r in first for x in r["ratio"]]
    assert max(abs(x - 1) for x in ratios) < 0.05, ratios
    assert max(abs(x) for r in first for x in r["ref_kl"]) <= 1e-4
