"""flowrl label without a browser: the labels.jsonl log (undo, restart, durability) and every refusal of
bad input in one sentence with nothing lost: a corrupted line, missing images, a pair labelled twice
(two tabs), a request without the token, a foreign Host, a form post. The page itself is driven in a
real Chromium in test_labeling_browser.py."""

from __future__ import annotations

import shutil

import pytest
from labeling_support import LabelServer, call, records, run_label_cli, shared_pairs

from flowrl.errors import FlowRLError
from flowrl.preferences.labels import LabelLog, labelled_pairs, left_slot, preferred_slot, read_labels
from flowrl.preferences.pairs import SLOTS, image_path, read_pairs


@pytest.fixture
def fresh(tmp_path_factory, tmp_path):
    """A private copy of 6 real pairs (each test writes its own labels.jsonl)."""
    return shared_pairs(tmp_path_factory, tmp_path / "pairs")


def test_log_replays_labels_and_undo_and_a_reopened_log_continues(fresh):
    log = LabelLog(fresh, 6)
    for pair, choice in [(0, "left"), (1, "right"), (2, "tie"), (3, "skip")]:
        log.append({"pair": pair, "choice": choice, "preferred": preferred_slot(pair, choice)})
    log.append({"undo": 3})  # withdraws pair 3's skip
    log.close()
    lines = (fresh / "labels.jsonl").read_text().splitlines()
    assert [r["seq"] for r in records(fresh)] == [0, 1, 2, 3, 4] and len(lines) == 5
    assert records(fresh)[4]["undo"] == 3
    state = LabelLog(fresh, 6).state  # a restart
    assert sorted(state.labels) == [0, 1, 2] and state.first_unlabelled() == 3 and state.next_seq == 5
    assert state.counts() == {"labelled": 3, "total": 6, "preferences": 2, "ties": 1, "skips": 0}
    # what a click means: left is the stored sample shown on the left, a fixed coin flip per pair
    assert {left_slot(i) for i in range(6)} == set(SLOTS)
    assert preferred_slot(1, "right") == SLOTS[1 - SLOTS.index(left_slot(1))]
    # training reads the decisive ones, the preferred sample first
    stored, labelled = read_pairs(fresh), labelled_pairs(fresh)
    assert labelled.pairs.prompts == [stored.prompts[0], stored.prompts[1]]
    for row, pair in enumerate([0, 1]):
        first = stored.winners[pair] if state.labels[pair]["preferred"] == "winner" else stored.losers[pair]
        assert labelled.pairs.winners[row].equal(first)
        assert labelled.pairs.trajectories.winners[row, -1].equal(first)


@pytest.mark.slow
def test_a_corrupted_line_stops_the_server_and_training_in_one_sentence_and_nothing_is_changed(fresh):
    good = '{"seq": 0, "pair": 0, "choice": "skip", "preferred": "skip", "time": "t"}\n'
    (fresh / "labels.jsonl").write_text(good + '{"seq": 1, "pair": 1, "choi\n')  # a torn write
    before = (fresh / "labels.jsonl").read_bytes()
    done = run_label_cli(str(fresh), "--port", "0")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "labels.jsonl' line 2 is not a valid label record (it is not valid JSON)" in done.stderr
    with pytest.raises(FlowRLError, match="line 2 is not a valid label record"):
        labelled_pairs(fresh)
    (fresh / "labels.jsonl").write_text(good + '{"seq": 1, "pair": 9, "choice": "left", "preferred": "winner"}\n')  # no pair 9
    with pytest.raises(FlowRLError, match=r"line 2 is not a valid label record \(its 'pair' must be an index from 0 to 5\)"):
        read_labels(fresh / "labels.jsonl", 6)
    (fresh / "labels.jsonl").write_bytes(before)
    assert (fresh / "labels.jsonl").read_bytes() == before


@pytest.mark.slow
def test_missing_images_can_only_be_skipped_and_no_images_at_all_is_refused(fresh, tmp_path):
    image_path(fresh, 2, "loser").unlink()
    with LabelServer(fresh) as server:
        status, answer = call(server.base + "api/label", {"pair": 2, "choice": "left"})
        assert status == 409 and answer["error"] == (
            "pair 2 cannot be compared because images/000002_loser.png is missing from the pairs directory; only skip is possible."
        )
        assert answer["current"]["pair"] == 2 and answer["current"]["missing"] == ["images/000002_loser.png"]
        assert call(server.base + "api/label", {"pair": 2, "choice": "skip"})[0] == 200
        assert call(server.base + "image/2/loser.png")[0] == 404
    err = server.stop()
    assert server.proc.returncode == 0  # SIGTERM (as Ctrl-C) stops the page cleanly: exit 0, not the re-raised signal
    assert (
        "1 of 6 pairs have a missing image (first: images/000002_loser.png); the page shows them as missing and they can only be skipped."
        in err
    )
    assert [(r["pair"], r["choice"]) for r in records(fresh)] == [(2, "skip")]
    shutil.rmtree(fresh / "images")
    done = run_label_cli(str(fresh), "--port", "0")
    assert done.returncode == 2 and "has no images/ folder, so there is nothing to show" in done.stderr


@pytest.mark.slow
def test_two_tabs_on_one_pair_the_second_click_is_refused_and_a_stale_undo_too(fresh):
    with LabelServer(fresh) as server:
        assert call(server.base + "api/state")[1]["current"]["pair"] == 0  # both tabs show pair 0
        status, first = call(server.base + "api/label", {"pair": 0, "choice": "left"})  # tab A
        status_b, second = call(server.base + "api/label", {"pair": 0, "choice": "right"})  # tab B, still on pair 0
        assert status == 200 and first["saved"] == 0 and first["current"]["pair"] == 1
        assert status_b == 409 and second["error"].startswith(
            "pair 0 was already labelled 'left' (in another tab or window); nothing was saved"
        )
        assert second["current"]["pair"] == 1
        call(server.base + "api/label", {"pair": 1, "choice": "tie"})  # tab B goes on
        status, stale = call(server.base + "api/undo", {"seq": 0})  # tab A still thinks its click is the last
        assert status == 409 and stale["error"].startswith(
            "the last label is now pair 1's, saved in another tab or window; nothing was undone"
        )
        status, undone = call(server.base + "api/undo", {"seq": 1})
        assert status == 200 and undone["undone"] == 1 and undone["current"]["pair"] == 1
        assert call(server.base + "api/label", {"pair": 7, "choice": "left"})[0] == 400
        assert call(server.base + "api/label", {"pair": 1, "choice": "up"})[0] == 400
    assert [(r.get("pair"), r.get("choice"), r.get("undo")) for r in records(fresh)] == [
        (0, "left", None),
        (1, "tie", None),
        (None, None, 1),
    ]


@pytest.mark.slow
def test_token_host_and_content_type_guards(fresh):
    with LabelServer(fresh, "--host", "0.0.0.0") as server:  # any other address: a token is generated and printed
        assert server.token and len(server.token) >= 24 and f":{server.port}/?token=" in server.url
        status, text = call(server.base)
        assert status == 401 and text.strip() == (
            "this labelling server needs its access token: open the address that `flowrl label` printed (it ends in ?token=...)."
        )
        status, answer = call(server.base + "api/label", {"pair": 0, "choice": "left"}, headers={"X-FlowRL-Token": "wrong"})
        assert status == 401 and "needs its access token" in answer["error"]
        assert call(server.base + "image/0/winner.png")[0] == 401
        assert call(server.base + f"?token={server.token}")[0] == 200
        assert call(server.base + "api/label", {"pair": 0, "choice": "skip"}, headers={"X-FlowRL-Token": server.token})[0] == 200
    with LabelServer(fresh, env={"FLOWRL_LABEL_TOKEN": "my-own-token"}) as server:  # loopback with a token: checked too
        token = {"X-FlowRL-Token": "my-own-token"}
        assert server.token == "my-own-token" and call(server.base + "api/state")[0] == 401
        # on loopback only loopback Host names are answered (DNS rebinding), token or not
        status, answer = call(server.base + "api/state", headers={"Host": f"attacker.example:{server.port}", **token})
        assert status == 403 and answer["error"] == "this labelling server answers only requests addressed to 127.0.0.1 or localhost."
        status, answer = call(
            server.base + "api/label", data=b"pair=1&choice=left", headers={"Content-Type": "application/x-www-form-urlencoded", **token}
        )  # what a cross-site form sends
        assert status == 415 and answer["error"] == "labels are sent as JSON (Content-Type: application/json); nothing was saved."
        status, answer = call(server.base + "api/state?token=my-own-token")
        assert status == 200 and answer["progress"]["labelled"] == 1 and answer["current"]["pair"] == 1
    assert [(r["pair"], r["choice"]) for r in records(fresh)] == [(0, "skip")]


@pytest.mark.slow
def test_a_failed_write_saves_nothing_and_leaves_the_file_whole(fresh):
    """A real write failure (the file-size limit: EFBIG, as a full disk gives ENOSPC) in a separate process:
    one sentence, the state and the file exactly as before."""
    import subprocess
    import sys

    (fresh / "labels.jsonl").write_text('{"seq": 0, "pair": 0, "choice": "skip", "preferred": "skip", "time": "t"}\n')
    before = (fresh / "labels.jsonl").read_bytes()
    script = f"""
import resource, signal
from flowrl.errors import FlowRLError
from flowrl.preferences.label_server import LabelSession
session = LabelSession.open({str(fresh)!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 20}, resource.RLIM_INFINITY))
status, answer = session.label(1, "left")
print(status, answer["error"], answer["progress"]["labelled"], answer["current"]["pair"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.strip() == f"500 could not save the label to '{fresh / 'labels.jsonl'}': the file is too large; nothing was saved. 1 1"
    )
    assert (fresh / "labels.jsonl").read_bytes() == before


def test_training_on_human_labels_refuses_what_it_cannot_use_in_one_sentence(fresh, tmp_path):
    from conftest import fast_overrides
    from labeling_support import D3PO

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    with pytest.raises(FlowRLError, match=r"has no labels.jsonl; label its pairs first with `flowrl label .*pairs`\.$"):
        labelled_pairs(fresh)
    log = LabelLog(fresh, 6)
    log.append({"pair": 0, "choice": "tie", "preferred": "tie"})
    log.append({"pair": 1, "choice": "skip", "preferred": "skip"})
    log.close()
    with pytest.raises(FlowRLError, match=r"prefers one sample in none of the 6 pairs \(1 ties, 1 skips, 4 unlabelled\)"):
        labelled_pairs(fresh)
    log = LabelLog(fresh, 6)
    log.append({"pair": 2, "choice": "left", "preferred": preferred_slot(2, "left")})
    log.close()
    (fresh / "trajectories.safetensors").unlink()  # Diffusion-DPO's kind of pairs: D3PO cannot re-score their steps
    overrides = fast_overrides(tmp_path / "run", **{"objective.preference": "human", "prompts.pairs": str(fresh)})
    with pytest.raises(
        FlowRLError,
        match="trains on the denoising trajectories of the pairs, and .* has none; build the pairs with "
        r"python -m flowrl.preferences.pairs CONFIG --trajectories\.$",
    ):
        Trainer(load_config(D3PO, overrides))
    assert not (tmp_path / "run").exists()
