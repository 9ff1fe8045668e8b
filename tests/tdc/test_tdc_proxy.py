"""Proxy-based pruning: memory bank, proposers (local, uniform, llm against a local HTTP server), search loop."""

from __future__ import annotations

import json
import math
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from diffcurr_fast.diffusion import DDPMSchedule
from diffcurr_fast.models import DiT
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.grouping import make_groups
from diffcurr_fast.tdc.llm import LLMProposer, parse_reply
from diffcurr_fast.tdc.proposers import LocalProposer, make_proposer
from diffcurr_fast.tdc.proxy import proxy_loss, recover
from diffcurr_fast.tdc.prune import importance_scores, select_widths
from diffcurr_fast.tdc.search import (
    Candidate,
    MemoryBank,
    ProposerUnavailable,
    SearchState,
    plot_history,
    proxy_search,
    validate_widths,
)

TINY = dict(
    input_size=4,
    patch_size=2,
    in_channels=3,
    hidden_size=24,
    depth=3,
    num_heads=3,
    mlp_ratio=2.5,
    num_classes=4,
    num_timesteps=100,
    attn_backend="math",
)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = DiT(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.08)
    s = DDPMSchedule(100)
    group = make_groups(s, 3, 0.5, dit_flops(model))[2]
    g = torch.Generator().manual_seed(1)
    train = [(torch.randn(5, 3, 4, 4, generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(2)]
    held = [(torch.randn(3, 3, 4, 4, generator=g), torch.randint(0, 4, (3,), generator=g))]
    imp = importance_scores(model, "taylor", objective=s, group=group, batches=train)
    return model, s, group, train, held, imp


def test_memory_bank():
    bank = MemoryBank()
    bank.add(Candidate([1, 2], [3, 4], 10, 0.5))
    bank.add(Candidate([2, 2], [3, 4], 12, 0.25))
    assert len(bank) == 2 and ([1, 2], [3, 4]) in bank and ([0, 0], [0, 0]) not in bank
    assert [c.score for c in bank.best(5)] == [0.25, 0.5]
    with pytest.raises(ValueError, match="already"):
        bank.add(Candidate([1, 2], [3, 4], 10, 0.1))
    with pytest.raises(ValueError, match="finite score"):
        bank.add(Candidate([0, 2], [3, 4], 10, float("nan")))
    assert json.loads(json.dumps(bank.to_list()))[1]["flops"] == 12


def test_validate_widths(setup):
    model, s, group, *_, imp = setup
    state = SearchState.for_model(model, group.flops, imp)
    h, m = select_widths(model.config(), imp, group.flops)
    assert validate_widths(state, h, m) is None
    assert validate_widths(state, [4, 0, 0], [0, 0, 0]) == "heads[0]=4 out of range [0, 3]"
    assert validate_widths(state, [0, 0, 0], [61, 0, 0]) == "mlp_hidden[0]=61 out of range [0, 60]"
    assert validate_widths(state, [1, 1], [1, 1, 1]) == "heads must be a list of 3 ints"
    assert validate_widths(state, [1, 1, 1], [1, 1]) == "mlp_hidden must be a list of 3 ints"
    assert validate_widths(state, [1, 1.5, 1], [1, 1, 1]) == "heads[1] must be an int, got 1.5"
    assert "over budget" in validate_widths(state, [3] * 3, [60] * 3)


def test_search_state_describe_is_what_the_llm_proposer_sees(setup):
    from diffcurr_fast.tdc.prune import unit_costs

    model, s, group, *_, imp = setup
    bank = MemoryBank()
    for i, score in enumerate([0.5, 0.25, 0.75]):
        bank.add(Candidate([3, 3, i + 1], [60, 60, 60 - i], 100 + i, score))
    state = SearchState.for_model(model, group.flops, imp, bank, round=2)
    per_head, per_channel = unit_costs(model.config())
    got = state.describe(top=2)
    assert got == {
        "depth": 3,
        "max_heads": [3, 3, 3],
        "max_mlp_hidden": [60, 60, 60],
        "flops_budget": float(group.flops),
        "base_flops": dit_flops(model),
        "flops_per_head": per_head,
        "flops_per_mlp_channel": per_channel,
        "round": 2,
        "memory_bank_best_first": [
            {"heads": [3, 3, 2], "mlp_hidden": [60, 60, 59], "flops": 101, "proxy_loss": 0.25},
            {"heads": [3, 3, 1], "mlp_hidden": [60, 60, 60], "flops": 100, "proxy_loss": 0.5},
        ],
    }
    assert json.loads(json.dumps(got)) == got  # the prompt is JSON


def test_search_state_file_resumes_exactly_and_loads_no_pickled_objects(setup, tmp_path):
    import copy
    import pickle

    from diffcurr_fast.tdc.search import _load_state, _rebuild, _save_state

    model = setup[0]
    path = tmp_path / "search_state.pt"
    rng = random.Random(5)
    rng.random()
    bank = MemoryBank()
    bank.add(Candidate([3, 3, 3], [60, 60, 60], 10, 0.5, 0, "local"))
    # a round whose candidates all scored non-finite leaves no best model: the resume must accept that
    _save_state(path, 1, bank, rng, [{"round": 0}], {"nonfinite": 1}, None)
    bank2, rng2, history, rejected = MemoryBank(), random.Random(0), [], {}
    assert _load_state(path, model, bank2, rng2, history, rejected) == (1, None)
    assert bank2.to_list() == bank.to_list() and history == [{"round": 0}] and rejected == {"nonfinite": 1}
    assert rng2.random() == rng.random()  # the proposer's RNG continues where it stopped
    # the best model is rebuilt in the searched model's class and dtype, from weights that must match its config
    like = copy.deepcopy(model).double()
    weights = {k: v.double() for k, v in model.state_dict().items()}
    best = _rebuild(like, model.config(), weights)
    assert next(best.parameters()).dtype == torch.float64 and not best.training
    weights.pop(next(iter(weights)))
    with pytest.raises(RuntimeError, match="Missing key"):
        _rebuild(like, model.config(), weights)
    # weights_only: a state file that carries a pickled object is refused, not executed
    state = torch.load(path, weights_only=True)
    state["history"] = [Candidate([1], [1], 1)]
    torch.save(state, path)
    with pytest.raises(pickle.UnpicklingError):
        _load_state(path, model, MemoryBank(), random.Random(0), [], {})


def _search(setup, **kw):
    model, s, group, train, held, imp = setup
    base = dict(objective=s, importance=imp, proposer=LocalProposer(), rounds=2, candidates_per_round=2, seed=3)
    return proxy_search(model, group, group.flops, train, held, **{"recover_steps": 1, **base, **kw})


def test_an_interrupted_search_resumes_from_its_state_file(setup, tmp_path, monkeypatch):
    from diffcurr_fast.tdc import search as search_mod

    whole = _search(setup)
    assert _search(setup).bank.to_list() == whole.bank.to_list()  # the proposer's RNG is seeded from seed
    path = tmp_path / "search_state.pt"
    _search(setup, rounds=1, state_path=path)  # stopped after round 0
    assert path.is_file()
    scored, real = [], search_mod._score_candidate
    monkeypatch.setattr(search_mod, "_score_candidate", lambda *a: scored.append(a[10]) or real(*a))
    resumed = _search(setup, state_path=path)
    assert scored == [1, 1]  # round 0 came from the file
    assert [c["round"] for c in resumed.bank.to_list()] == [0, 0, 1, 1]
    assert resumed.bank.to_list() == whole.bank.to_list() and resumed.history == whole.history
    assert resumed.rejected == whole.rejected and resumed.best == whole.best
    for a, b in zip(resumed.model.state_dict().values(), whole.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_nonfinite_candidate_is_counted_and_the_search_goes_on(setup, monkeypatch, caplog):
    import logging

    from diffcurr_fast.tdc import search as search_mod

    calls, real = [], search_mod.proxy_loss

    def round0_diverges(*a, **k):  # both recoveries of round 0 diverged
        calls.append(1)
        return float("nan") if len(calls) <= 2 else real(*a, **k)

    monkeypatch.setattr(search_mod, "proxy_loss", round0_diverges)
    with caplog.at_level(logging.INFO, logger=search_mod.__name__):
        res = _search(setup)
    assert len(calls) == 4 and len(res.bank) == 2 and res.rejected["nonfinite"] == 2
    assert [h["n"] for h in res.history] == [0, 2]
    assert all(math.isnan(res.history[0][k]) for k in ("mean", "std", "min", "best_so_far"))
    best = min(c.score for c in res.bank.entries)
    assert f"proxy search round 1: 2 candidates, proxy mean {res.history[1]['mean']:.5g} std " in caplog.text
    assert f"best so far {best:.5g}" in caplog.text


def test_proxy_search_passes_its_options_on(setup, monkeypatch, tmp_path):
    from diffcurr_fast.tdc import search as search_mod

    pruned, recovered = [], []
    real_prune, real_recover = search_mod.prune_to_widths, search_mod.recover
    monkeypatch.setattr(search_mod, "prune_to_widths", lambda *a, **k: pruned.append(k) or real_prune(*a, **k))
    monkeypatch.setattr(search_mod, "recover", lambda *a, **k: recovered.append(k) or real_recover(*a, **k))
    res = _search(setup, rounds=1, drop_empty_blocks=True, lr=3e-3, log_path=tmp_path / "search.json")
    assert pruned and all(k["drop_empty_blocks"] is True for k in pruned)
    assert recovered and all(k["lr"] == 3e-3 for k in recovered)
    log = json.loads((tmp_path / "search.json").read_text())
    assert log["history"] == json.loads(json.dumps(res.history)) and log["rejected"] == res.rejected

    class Untouched:  # a fallback must not be asked (nor draw from the RNG) when the proposer filled the round
        name = "untouched"

        def propose(self, state, n, rng):
            raise AssertionError("the fallback was asked for a full round")

    assert len(_search(setup, rounds=1, candidates_per_round=1, fallback=Untouched()).bank) == 1


def test_proxy_search_input_errors_name_the_argument(setup):
    from diffcurr_fast.tdc.flops import widths_flops
    from diffcurr_fast.tdc.search import _check_search

    model = setup[0]
    for kw, exc, match in (
        ({"rounds": 0}, ValueError, r"^rounds must be an int >= 1, got 0$"),
        ({"rounds": True}, ValueError, r"^rounds must be an int >= 1, got True$"),
        ({"candidates_per_round": 2.5}, ValueError, r"^candidates_per_round must be an int >= 1, got 2.5$"),
        ({"proposer": None}, TypeError, r"^proposer must be a Proposer"),
        ({"fallback": "local"}, TypeError, r"^fallback must be a Proposer"),
    ):
        with pytest.raises(exc, match=match):
            _search(setup, **kw)
    floor = widths_flops(model.config(), [0, 0, 0], [0, 0, 0])  # every unit removed
    _check_search(model, floor, LocalProposer(), None, 1, 1)  # the floor itself is a valid budget
    for budget in (floor - 1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^budget .* must be a finite number >= "):
            _check_search(model, budget, LocalProposer(), None, 1, 1)


@pytest.mark.parametrize("name", ["local", "uniform"])
def test_builtin_proposers(setup, name):
    model, s, group, *_, imp = setup
    state = SearchState.for_model(model, group.flops, imp)
    proposer = make_proposer(name)
    props = proposer.propose(state, 5, random.Random(0))
    assert 1 <= len(props) <= 5
    assert len({(tuple(h), tuple(m)) for h, m in props}) == len(props)
    head_cost, mlp_cost = state.head_cost, state.mlp_cost
    for h, m in props:
        assert validate_widths(state, h, m) is None
        assert state.budget - state.flops(h, m) < 4 * max(head_cost, mlp_cost) * len(h)  # uses most of the budget
    if name == "local":
        assert props[0] == select_widths(model.config(), imp, group.flops)  # importance-greedy seed first
        for h, m in props:  # a later round mutates around the bank's best and avoids repeats
            state.bank.add(Candidate(h, m, state.flops(h, m), float(sum(m))))
        more = proposer.propose(state, 4, random.Random(1))
        assert more and all((h, m) not in state.bank for h, m in more)
    else:
        for h, m in props:  # same kept ratio in every block
            assert len(set(h)) == 1 and len(set(m)) == 1
    with pytest.raises(ValueError, match="valid choices"):
        make_proposer("genetic")
    with pytest.raises(ValueError, match="parents"):
        LocalProposer(parents=0)


def test_recover_and_proxy(setup):
    model, s, group, train, held, imp = setup
    import copy

    m = copy.deepcopy(model)
    before = proxy_loss(m, group, train, objective=s)
    assert proxy_loss(m, group, train, objective=s) == before  # fixed draws: deterministic
    losses = recover(m, group, train, 6, objective=s, lr=3e-3)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert proxy_loss(m, group, train, objective=s) < before
    assert not m.training
    with pytest.raises(ValueError, match="steps"):
        recover(m, group, train, -1, objective=s)
    with pytest.raises(ValueError, match="held-out"):
        proxy_loss(m, group, [], objective=s)


def test_proxy_search_local(setup, tmp_path):
    model, s, group, train, held, imp = setup
    res = proxy_search(
        model,
        group,
        group.flops,
        train,
        held,
        objective=s,
        importance=imp,
        proposer=LocalProposer(),
        rounds=2,
        candidates_per_round=3,
        recover_steps=1,
        log_path=tmp_path / "search.json",
    )
    assert len(res.history) == 2 and len(res.bank) == 6
    assert res.best.score == min(c.score for c in res.bank.entries)
    assert all(c.flops <= group.flops for c in res.bank.entries)
    assert dit_flops(res.model) == res.best.flops
    assert res.model.config()["block_num_heads"] == res.best.heads
    assert res.history[1]["best_so_far"] <= res.history[0]["best_so_far"]
    for h in res.history:
        assert h["n"] == 3 and h["std"] >= 0 and h["min"] <= h["mean"]
    logged = json.loads((tmp_path / "search.json").read_text())
    assert logged["best"]["score"] == res.best.score and len(logged["bank"]) == 6
    png = plot_history(res.history, tmp_path / "curve.png")
    assert png.stat().st_size > 1000
    with pytest.raises(ValueError, match="budget"):
        proxy_search(model, group, 1.0, train, held, objective=s, importance=imp, proposer=LocalProposer())
    with pytest.raises(TypeError, match="make_proposer"):  # a proposer object, not a name
        proxy_search(model, group, group.flops, train, held, objective=s, importance=imp, proposer="local")


# ---------------------------------------------------------------------------------------------- llm
class _Server:
    """Local OpenAI-compatible stub: replies are taken in order from ``self.replies``."""

    def __init__(self):
        self.replies: list = []
        self.requests: list = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": json.loads(body)}
                )
                kind, value = outer.replies.pop(0)
                if kind == "sleep":
                    time.sleep(value)
                    kind, value = "content", '{"candidates": []}'
                if kind == "status":
                    self.send_response(value)
                    self.end_headers()
                    return
                if kind == "content":
                    value = json.dumps({"choices": [{"message": {"role": "assistant", "content": value}}]})
                data = value.encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, client_address: None  # the timed-out client has hung up
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # urllib honours *_proxy variables
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    srv = _Server()
    yield srv
    srv.close()


def _content(cands) -> str:
    return json.dumps({"candidates": [{"heads": h, "mlp_hidden": m} for h, m in cands]})


def test_parse_reply_strict():
    body = json.dumps({"choices": [{"message": {"content": "```json\n" + _content([([1], [2])]) + "\n```"}}]})
    assert parse_reply(body) == [{"heads": [1], "mlp_hidden": [2]}]
    for bad in (
        "not json",
        json.dumps({"choices": []}),
        json.dumps({"choices": [{"message": {"content": "Sure! Here you go"}}]}),
        json.dumps({"choices": [{"message": {"content": '{"candidates": [{"heads": [1]}]}'}}]}),
        json.dumps({"choices": [{"message": {"content": '[{"heads": [1], "mlp_hidden": [1]}]'}}]}),
        json.dumps({"choices": [{"message": {"content": "```json\n{}"}}]}),
    ):
        with pytest.raises(ValueError):
            parse_reply(bad)


def test_llm_proposer_against_local_server(setup, server, monkeypatch):
    model, s, group, *_, imp = setup
    monkeypatch.setenv("TDC_TEST_LLM_KEY", "sk-local-test")
    state = SearchState.for_model(model, group.flops, imp)
    good = select_widths(model.config(), imp, group.flops)
    good2 = (list(good[0]), [max(0, v - 3) for v in good[1]])
    over = ([3, 3, 3], [60, 60, 60])
    out_of_range = ([5, 0, 0], [1, 1, 1])
    server.replies = [
        ("content", _content([good, over, out_of_range, good2, good])),  # the search checks them, not the proposer
        ("content", "this is not JSON"),
        ("raw", "{broken"),
        ("content", _content([over])),
        ("status", 500),
        ("sleep", 2.0),
    ]
    p = LLMProposer(server.url, "test-model", api_key_env="TDC_TEST_LLM_KEY", timeout=0.5, on_unreachable="report")
    rng = random.Random(0)
    assert p.propose(state, 4, rng) == [good, over, out_of_range, good2, good]
    req = server.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-local-test"
    assert req["body"]["model"] == "test-model"
    assert json.loads(req["body"]["messages"][1]["content"])["flops_budget"] == group.flops
    assert p.propose(state, 4, rng) == []  # not JSON
    assert p.propose(state, 4, rng) == []  # not a chat-completions body
    assert p.propose(state, 4, rng) == [over]
    for _ in range(2):  # HTTP 500, timeout
        assert p.propose(state, 4, rng) == []
    assert p.stats == {"requests": 6, "network_errors": 1, "timeouts": 1, "parse_errors": 2}


def test_unreachable_llm_is_an_error_unless_the_fallback_is_asked_for(setup, capsys):
    model, s, group, train, held, imp = setup
    url = "http://127.0.0.1:9/v1"  # nothing listens on the discard port: connection refused
    kw = dict(objective=s, importance=imp, fallback=LocalProposer(), rounds=2, candidates_per_round=2, recover_steps=0)
    with pytest.raises(
        ProposerUnavailable,
        match=r"endpoint http://127.0.0.1:9/v1/chat/completions gave no reply "
        r"\(URLError.*set tdc.llm_fallback=local",
    ):
        proxy_search(model, group, group.flops, train, held, proposer=LLMProposer(url, "m", timeout=5.0), **kw)
    capsys.readouterr()
    p = LLMProposer(url, "m", timeout=5.0, on_unreachable="report")
    res = proxy_search(model, group, group.flops, train, held, proposer=p, **kw)
    err = capsys.readouterr().err
    assert [c.source for c in res.bank.entries] == ["local"] * 4 and p.stats["network_errors"] == 2
    for r in range(2):  # said at every round
        assert f"tdc: round {r}: the llm endpoint gave no reply" in err and "come from the local proposer" in err
    with pytest.raises(ValueError, match="on_unreachable"):
        LLMProposer(url, "m", on_unreachable="ignore")


def test_llm_proposer_config_errors(monkeypatch):
    monkeypatch.delenv("TDC_TEST_MISSING_KEY", raising=False)
    with pytest.raises(ValueError, match="TDC_TEST_MISSING_KEY"):
        LLMProposer("http://127.0.0.1:1/v1", "m", api_key_env="TDC_TEST_MISSING_KEY")
    with pytest.raises(ValueError, match="url"):
        LLMProposer("ftp://x", "m")
    with pytest.raises(ValueError, match="timeout"):
        LLMProposer("http://127.0.0.1:1", "m", timeout=0)


def test_proxy_search_with_llm_and_fallback(setup, server):
    model, s, group, train, held, imp = setup
    good = select_widths(model.config(), imp, group.flops)
    server.replies = [("content", _content([good, ([3, 3, 3], [60, 60, 60])])), ("content", "nope")]
    p = LLMProposer(server.url, "m", timeout=5.0)
    res = proxy_search(
        model,
        group,
        group.flops,
        train,
        held,
        objective=s,
        importance=imp,
        proposer=p,
        fallback=LocalProposer(),
        rounds=2,
        candidates_per_round=2,
        recover_steps=0,
    )
    sources = [c.source for c in res.bank.entries]
    assert sources.count("llm") == 1 and sources.count("local") == 3  # the shortfall is filled locally
    assert res.rejected["over_budget"] == 1 and res.rejected["llm_parse_errors"] == 1
    assert len(server.requests) == 2
    assert len(json.loads(server.requests[1]["body"]["messages"][1]["content"])["memory_bank_best_first"]) == 2


class _BadProposer:
    """Returns an over-budget, an out-of-range and a malformed allocation, a good one twice, then ``more``."""

    name = "bad"

    def __init__(self, good, more=()):
        self.good, self.more = good, list(more)

    def propose(self, state, n, rng):
        return [([3, 3, 3], [60, 60, 60]), ([9, 0, 0], [0, 0, 0]), ([1, 1], [1, 1]), self.good, self.good, *self.more]


def test_proxy_search_rejects_and_counts(setup):
    model, s, group, train, held, imp = setup
    good = select_widths(model.config(), imp, group.flops)
    res = proxy_search(
        model,
        group,
        group.flops,
        train,
        held,
        objective=s,
        importance=imp,
        proposer=_BadProposer(good),
        fallback=LocalProposer(),
        rounds=1,
        candidates_per_round=2,
        recover_steps=0,
    )
    assert res.rejected == {"over_budget": 1, "invalid": 2, "duplicate": 1}
    assert [c.source for c in res.bank.entries] == ["bad", "local"]
    fewer = (list(good[0]), [max(0, v - 3) for v in good[1]])
    res = proxy_search(
        model,
        group,
        group.flops,
        train,
        held,
        objective=s,
        importance=imp,
        proposer=_BadProposer(good, [fewer]),
        rounds=1,
        candidates_per_round=1,
        recover_steps=0,
    )
    assert res.rejected == {"over_budget": 1, "invalid": 2, "duplicate": 1, "surplus": 1}  # one asked, two valid
    assert [(c.heads, c.mlp, c.source) for c in res.bank.entries] == [(*good, "bad")]
    with pytest.raises(ValueError, match="no valid candidate"):
        proxy_search(
            model,
            group,
            group.flops,
            train,
            held,
            objective=s,
            importance=imp,
            proposer=_BadProposer(([3, 3, 3], [60, 60, 60])),
            rounds=1,
        )


def test_search_imports_no_proposer():
    """The search sees proposers only through the ``Proposer`` protocol; the registry matches the config's names."""
    import ast
    import importlib

    from diffcurr_fast.tdc.proposers import _REGISTRY, PROPOSERS

    def imports(name):
        tree = ast.parse(open(importlib.import_module(name).__file__).read())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }

    assert not imports("diffcurr_fast.tdc.search") & {"diffcurr_fast.tdc.proposers", "diffcurr_fast.tdc.llm"}
    assert not imports("diffcurr_fast.tdc.llm") & {"diffcurr_fast.tdc.proposers", "diffcurr_fast.tdc.proxy"}
    assert tuple(_REGISTRY) == PROPOSERS
