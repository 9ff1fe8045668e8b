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
from diffcurr_fast.tdc import (
    Candidate,
    LLMProposer,
    LocalProposer,
    MemoryBank,
    ProposerUnavailable,
    SearchState,
    dit_flops,
    importance_scores,
    make_groups,
    make_proposer,
    parse_reply,
    plot_history,
    proxy_loss,
    proxy_search,
    recover,
    select_widths,
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
    assert "out of range" in validate_widths(state, [4, 0, 0], [0, 0, 0])
    assert "out of range" in validate_widths(state, [0, 0, 0], [61, 0, 0])
    assert "must be a list" in validate_widths(state, [1, 1], [1, 1, 1])
    assert "must be an int" in validate_widths(state, [1, 1.5, 1], [1, 1, 1])
    assert "over budget" in validate_widths(state, [3] * 3, [60] * 3)


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

    from diffcurr_fast.tdc import PROPOSERS
    from diffcurr_fast.tdc.proposers import _REGISTRY

    def imports(name):
        tree = ast.parse(open(importlib.import_module(name).__file__).read())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }

    assert not imports("diffcurr_fast.tdc.search") & {"diffcurr_fast.tdc.proposers", "diffcurr_fast.tdc.llm"}
    assert not imports("diffcurr_fast.tdc.llm") & {"diffcurr_fast.tdc.proposers", "diffcurr_fast.tdc.proxy"}
    assert tuple(_REGISTRY) == PROPOSERS
