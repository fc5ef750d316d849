"""
The report as one self-contained HTML page: rendered from the JSON's numbers, escaped, offline; and opened in a real
browser (headless Chromium driven by Playwright) on the default audit's page.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from art_malleability.audit.report_html import CONTROL_COLUMNS, FORMATS, HEADLINE, HTML_NAME, lookup

#: Where CI requires the browser test to run (``.ci/run`` installs Debian's chromium and sets it); elsewhere the test is
#: skipped, saying why, when no chromium is installed.
REQUIRED = os.environ.get("ART_MALLEABILITY_BROWSER_TESTS") == "required"
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "figures" / "report_html.png"


def chromium() -> str | None:
    """The Chromium executable: ``$CHROMIUM``, else Debian's ``chromium`` on the path."""
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def default_audit(tmp_path_factory):
    """The default audit's reports (``art-malleability audit``, no options), one folder per model."""
    from art_malleability.cli import main

    where = tmp_path_factory.mktemp("default")
    assert main(["audit", "--output", str(where / "out"), "--no-work-dir", "--quiet"]) == 0
    return where / "out"


def test_the_page_is_self_contained_and_holds_the_jsons_headline(default_audit):
    for model in ("2l-relu", "mlp-attn"):
        page = (default_audit / model / HTML_NAME).read_text(encoding="utf-8")
        data = json.loads((default_audit / model / "report.json").read_text())
        assert len(page.encode()) < 2_000_000
        # nothing leaves the file: every image inline, no script, no stylesheet or font fetched
        assert all(src.startswith("data:image/png;base64,") for src in re.findall(r'src="([^"]*)"', page))
        assert "<script" not in page and not re.search(r"(href|src)=\"(https?:)?//", page)
        keys = re.findall(r'data-key="([^"]+)"', page)
        n = len(data["results"])
        headline = [f"results.{i}.{column[1]}" for i in range(n) for column in HEADLINE]
        controls = [f"results.{i}.{column[1]}" for i in range(n) for column in CONTROL_COLUMNS
                    if data["results"][i]["control"] is not None]
        assert controls and keys == headline + controls
        for warning in data["warnings"]:
            assert page.count(_escaped(warning)) == 1  # each once
        # how to run it again: the command line that ran it, then the library call
        command = f"art-malleability audit --output {default_audit} --no-work-dir --quiet"
        assert data["execution"]["command"] == command and _escaped(command) in page.split('id="reproduce"')[1]
        assert "MalleabilityEstimator(classifier, " in page.split('id="reproduce"')[1]


def test_the_page_escapes_what_it_shows(default_audit):
    from art_malleability.audit.report import MalleabilityReport

    report = MalleabilityReport.load(default_audit / "2l-relu")
    report.model = "<img src=x onerror=alert(1)>"
    report.warnings = [*report.warnings, "<script>alert(2)</script>"]
    page = report.to_html()
    assert "<script>alert(2)" not in page and "&lt;script&gt;alert(2)&lt;/script&gt;" in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page


def test_an_undecided_rate_is_written_as_undecided_never_as_a_point(default_audit):
    from art_malleability.audit._reading import undecided

    page = (default_audit / "2l-relu" / HTML_NAME).read_text(encoding="utf-8")
    data = json.loads((default_audit / "2l-relu" / "report.json").read_text())
    for i, r in enumerate(data["results"]):
        cell = re.search(rf'<td[^>]*data-key="results\.{i}\.flip_rate_above_floor"[^>]*>([^<]*)</td>', page)
        is_undecided = undecided(r["flip_rate_above_floor"], r["flip_rate_above_floor_ci"], r["undecided_share"])
        assert ('data-undecided="true"' in cell.group(0)) == is_undecided
        assert cell.group(1).startswith("undecided [") == is_undecided


@pytest.mark.skipif(chromium() is None and not REQUIRED,
                    reason="no chromium installed (CI installs Debian's and requires this test)")
def test_the_default_audits_page_in_a_real_browser(default_audit, tmp_path):
    from playwright.sync_api import sync_playwright

    assert chromium() is not None, "ART_MALLEABILITY_BROWSER_TESTS=required, but no chromium is installed"
    page_file = default_audit / "2l-relu" / HTML_NAME
    data = json.loads((default_audit / "2l-relu" / "report.json").read_text())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors, requests = [], []
            page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri(), wait_until="load")
            shown = ("els => els.map(e => [e.dataset.figure || e.dataset.thumbnail, e.complete, e.naturalWidth,"
                     " e.naturalHeight, e.getBoundingClientRect().width, e.getBoundingClientRect().height])")
            images = page.eval_on_selector_all("img[data-figure]", shown)
            thumbnails = page.eval_on_selector_all("img[data-thumbnail]", shown)
            assert page.eval_on_selector_all("img", "els => els.length") == len(images) + len(thumbnails)
            cells = page.eval_on_selector_all(
                "[data-key]", "els => els.map(e => [e.dataset.key, e.dataset.intervalKey, e.dataset.shareKey,"
                              " e.dataset.value, e.dataset.low, e.dataset.high, e.dataset.format,"
                              " e.innerText.trim()])")
            page.screenshot(path=str(tmp_path / "page.png"))
        finally:
            browser.close()
    assert errors == []
    assert requests == [page_file.as_uri()]  # the page itself, nothing else (data: images are not requests)
    names = sorted(p.name for p in page_file.parent.glob("*.png"))
    assert sorted(i[0] for i in images) == names
    examples = [e for r in data["results"] for e in r["examples"]]
    assert examples and len(thumbnails) == 2 * len(examples)  # digits are images: clean and attacked side by side
    assert [t[0] for t in thumbnails] == ["clean", "attacked"] * len(examples)
    for name, complete, natural_w, natural_h, width, height in images + thumbnails:
        assert complete and natural_w > 0 and natural_h > 0 and width > 0 and height > 0, name
    with_control = sum(r["control"] is not None for r in data["results"])
    assert len(cells) == len(data["results"]) * len(HEADLINE) + with_control * len(CONTROL_COLUMNS)
    for key, interval_key, share_key, value, low, high, style, text in cells:
        expected = lookup(data, key)
        assert json.loads(value) == expected, key
        ci = lookup(data, interval_key) if interval_key else [None, None]
        assert [json.loads(low), json.loads(high)] == list(ci), key
        share = lookup(data, share_key) if share_key else None
        assert text == FORMATS[style](expected, ci, share), key
    if os.environ.get("ART_MALLEABILITY_UPDATE_SCREENSHOT"):  # the docs figure, kept in the repository
        shutil.copyfile(tmp_path / "page.png", SCREENSHOT)


def _escaped(text: str) -> str:
    """``text`` as Jinja2's autoescape writes it."""
    import markupsafe

    return str(markupsafe.escape(text))


def test_lookup_reads_dotted_paths_of_the_json():
    data = {"results": [{"flip_rate": 0.25, "control": None, "ci": [0.1, math.inf]}]}
    assert lookup(data, "results.0.flip_rate") == 0.25
    assert lookup(data, "results.0.control.flip_rate") is None
    assert lookup(data, "results.0.ci.1") == math.inf


def test_a_tabular_audit_without_controls_shows_its_examples_as_values(tmp_path):
    import numpy as np
    import torch
    from helpers import digits

    from art_malleability.audit.estimator import MalleabilityEstimator
    from art_malleability.audit.examples import MAX_VALUES
    from art_malleability.models import make_classifier, train_model

    data = digits()
    x, y = data.x_train.reshape(len(data.x_train), -1), data.y_train  # 64 features: not an image
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    net = train_model(net, x, y, epochs=30, batch_size=200, lr=0.05, seed=0, verbose=False, device="cpu")
    clf = make_classifier(net, (64,), 10, device="cpu")
    report = MalleabilityEstimator(clf, attacks=("fgsm",), controls=False, n_bootstrap=50, n_queries=30,
                                   verbose=False, device="cpu").evaluate(x, y)
    examples = report.results[0].examples
    assert examples and all("clean_values" in e and "clean_png" not in e for e in examples)
    e = examples[0]
    assert len(e["clean_values"]) == min(64, MAX_VALUES)
    assert e["linf"] == pytest.approx(float(np.max(np.abs(np.array(e["attacked_values"]) - e["clean_values"]))),
                                      abs=1e-5)
    page = report.to_html()
    assert "<img" not in page.split('id="examples"')[1].split('id="warnings"')[0]  # values, not thumbnails
    assert f'data-index="{e["index"]}"' in page and "clean: " in page
    assert 'id="controls-table"' not in page
    keys = re.findall(r'data-key="([^"]+)"', page)
    assert keys == [f"results.0.{column[1]}" for column in HEADLINE]
    cell = re.search(r'data-key="results\.0\.control\.flip_rate"[^>]*>([^<]*)<', page)
    assert cell.group(1) == "n/a"  # no control: said, not left blank
