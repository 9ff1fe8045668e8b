"""diffusers interop both ways, offline with tiny models: ``export --to diffusers`` (transformer, scheduler, the
latent ``DiTPipeline`` with its VAE) against our forward and our samplers, and ``model.init_from`` reading a
diffusers directory back bitwise. Skipped, with the reason, when diffusers is not installed.

diffusers' DiT embeds the timestep at frequencies 10000^(-i / (half - 1)), the release at 10000^(-i / half)
(``models/diffusers_dit.py``). The output comparisons therefore run our DiT with diffusers' timestep features
(``diffusers_time``, from diffusers' own ``get_timestep_embedding``): every weight and every other op is then the
same, and ``test_timestep_frequency_gap`` pins the one difference that is left."""

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install diffusers)")

from conftest import assert_near_reference, random_weights, save_tiny_vae, tiny_dit_overrides  # noqa: E402

from diffcurr_fast import cli  # noqa: E402
from diffcurr_fast.cli_export import export_diffusers, scheduler_config, to_diffusers_transformer  # noqa: E402
from diffcurr_fast.diffusion import Readout, ddim_sample, flow_sample, make_generator  # noqa: E402
from diffcurr_fast.models import DiT  # noqa: E402
from diffcurr_fast.models import dit as dit_module  # noqa: E402
from diffcurr_fast.runs.checkpoint import atomic_save  # noqa: E402
from diffcurr_fast.runs.recipes import load_config  # noqa: E402
from diffcurr_fast.runs.sampling import (  # noqa: E402
    build_model,
    build_schedule,
    guided_model_output,
    respaced,
    sample,
)
from diffcurr_fast.train.data import load_init_weights  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def diffusers_time(monkeypatch):
    """Our DiT with diffusers' timestep features (``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)``)."""
    from diffusers.models.embeddings import get_timestep_embedding

    def embed(t, dim, max_period=10000, dtype=torch.float32):
        return get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=1).to(dtype)

    monkeypatch.setattr(dit_module.TimestepEmbedder, "timestep_embedding", staticmethod(embed))


def _checkpoint(tmp_path, *extra, std=0.05):
    """A hand-made checkpoint of a random-weight model of the config ``tiny_dit_overrides(...extra)``: (path, cfg,
    model)."""
    cfg = load_config(None, tiny_dit_overrides(tmp_path / "run", *extra))
    model = random_weights(build_model(cfg), std)
    sd = model.state_dict()
    path = atomic_save(
        {"config": cfg.to_dict(), "model": sd, "ema": {"module": sd}, "step": 1},
        tmp_path / "run" / "checkpoints" / "ckpt_00000001.pt",
    )
    return path, cfg, model


@pytest.mark.parametrize("learn_sigma", [True, False])
@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_exported_transformer_equals_ours(diffusers_time, learn_sigma, cfg_scale):
    torch.manual_seed(0)
    ours = random_weights(
        DiT(
            input_size=6,
            patch_size=3,
            in_channels=3,
            hidden_size=48,
            depth=2,
            num_heads=3,
            num_classes=7,
            learn_sigma=learn_sigma,
        )
    )
    theirs = to_diffusers_transformer(ours)
    assert theirs.config.out_channels == (6 if learn_sigma else 3)
    x, t, y = torch.randn(5, 3, 6, 6), torch.tensor([0, 3, 17, 42, 999]), torch.tensor([0, 6, 2, 7, 4])

    def diffusers_forward(xx, tt, yy):
        return theirs(xx, timestep=tt, class_labels=yy).sample

    with torch.no_grad():
        a = guided_model_output(ours, x, t, y[:5].clamp(max=6), cfg_scale, 7)
        b = guided_model_output(diffusers_forward, x, t, y[:5].clamp(max=6), cfg_scale, 7)
        null = ours(x, t, torch.full((5,), 7)), diffusers_forward(x, t, torch.full((5,), 7))  # the null label
    assert a.shape == b.shape == (5, 6 if learn_sigma else 3, 6, 6)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(null[1], null[0], rtol=1e-5, atol=1e-5)


def test_timestep_frequency_gap():
    """The one difference left: the same weights, diffusers' shifted timestep frequencies."""
    ours = random_weights(
        DiT(input_size=4, patch_size=2, in_channels=1, hidden_size=32, depth=1, num_heads=2, num_classes=3)
    )
    theirs = to_diffusers_transformer(ours)
    x, t, y = torch.randn(3, 1, 4, 4), torch.tensor([5, 300, 900]), torch.tensor([0, 1, 2])
    with torch.no_grad():
        gap = (ours(x, t, y) - theirs(x, timestep=t, class_labels=y).sample).abs().max()
    assert gap > 1e-4  # if diffusers adopts the release's frequencies, the docs' note on the gap must go


@pytest.mark.parametrize("prediction, kind", [("eps", "epsilon"), ("v", "v_prediction"), ("x0", "sample")])
def test_ddim_loop_through_diffusers_scheduler_equals_ddim_sample(tmp_path, diffusers_time, prediction, kind):
    """Unclipped (npz data): with clipping, ADM's DDIM (ours) recomputes eps from the clipped x0 and diffusers'
    keeps the network's, so the two part where x0 is clipped (``test_export_clips_like_the_run``)."""
    (tmp_path / "d").mkdir()
    path, cfg, model = _checkpoint(
        tmp_path, f"diffusion.prediction={prediction}", "data.dataset=npz", f"data.path={tmp_path / 'd'}"
    )
    out = tmp_path / "export"
    export_diffusers(str(path), out)
    net = diffusers.DiTTransformer2DModel.from_pretrained(out / "transformer").eval()
    sched = diffusers.DDIMScheduler.from_pretrained(out / "scheduler")
    assert sched.config.prediction_type == kind and not sched.config.clip_sample
    steps, labels = 10, torch.tensor([1, 5, 0, 6])
    noise = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(3))
    sched.set_timesteps(steps)
    x = noise.clone()
    with torch.no_grad():
        for t in sched.timesteps:
            tt = t.expand(4)
            eps = guided_model_output(lambda a, b, c: net(a, timestep=b, class_labels=c).sample, x, tt, labels, 1.5, 7)[
                :, :1
            ]
            x = sched.step(eps, t, x).prev_sample
        sch, tmap = respaced(build_schedule(cfg), "ddim", steps)
        ours = ddim_sample(
            model,
            sch,
            (4, 1, 6, 6),
            labels,
            num_classes=7,
            cfg_scale=1.5,
            readout=Readout(prediction, learn_sigma=True),
            timestep_map=tmap,
            noise=noise,
        )
    assert_near_reference(ours, x, 1e-5, "ours against diffusers")  # scaled: samples reach about 24


def test_export_clips_like_the_run(tmp_path):
    _, cfg, _ = _checkpoint(tmp_path)  # digits lie in [-1, 1]: our samplers clip x0, so does the scheduler
    assert scheduler_config(cfg)[1]["clip_sample"] is True


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return save_tiny_vae(tmp_path_factory.mktemp("vae") / "tiny-vae", levels=2, sample_size=12)


def test_latent_pipeline_equals_ours(tmp_path, vae_dir, diffusers_time):
    """A latent model (1000 classes: DiTPipeline's null label is 1000) through ``DiTPipeline.from_pretrained``,
    guidance and VAE decoding included, against ``ddim_sample`` and the same VAE."""
    lat = tmp_path / "lat"
    lat.mkdir()
    path, cfg, model = _checkpoint(
        tmp_path,
        "model.in_channels=4",
        "model.num_classes=1000",
        "data.dataset=npz",
        f"data.path={lat}",
        "data.scale=0.5",
        "logging.eval_every=0",
    )
    cfg.data.dataset = "latents"  # the checkpoint says latents: export then needs the VAE
    torch.save(
        {"config": cfg.to_dict(), "model": model.state_dict(), "ema": {"module": model.state_dict()}, "step": 1}, path
    )
    with pytest.raises(ValueError, match="pass --vae DIR"):
        export_diffusers(str(path), tmp_path / "nope")
    out = tmp_path / "pipe"
    export_diffusers(str(path), out, vae=str(vae_dir))
    pipe = diffusers.DiTPipeline.from_pretrained(out)
    assert pipe.vae.config.scaling_factor == 0.5
    labels = [3, 999]
    images = pipe(
        class_labels=labels,
        guidance_scale=2.0,
        num_inference_steps=6,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    noise = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0))
    sch, tmap = respaced(build_schedule(cfg), "ddim", 6)
    with torch.no_grad():
        z = ddim_sample(
            model,
            sch,
            (2, 4, 6, 6),
            torch.tensor(labels),
            num_classes=1000,
            cfg_scale=2.0,
            readout=Readout(learn_sigma=True),
            timestep_map=tmap,
            noise=noise,
        )
        ours = ((pipe.vae.decode(z / 0.5).sample / 2 + 0.5).clamp(0, 1)).permute(0, 2, 3, 1)
    images = torch.as_tensor(images)
    images = images if images.shape[-1] == 3 else images.permute(0, 2, 3, 1)
    assert images.shape == ours.shape == (2, 12, 12, 3)
    assert_near_reference(ours, images, 1e-5, "ours against diffusers")


def test_round_trip_export_then_init_from_is_bitwise(tmp_path):
    digits = ("model.input_size=8", "model.patch_size=2", "model.num_classes=10", "model.class_dropout_prob=0.0")
    path, cfg, model = _checkpoint(tmp_path, *digits)
    out = tmp_path / "export"
    assert cli.main(["export", str(tmp_path / "run"), "--to", "diffusers", str(out)]) == 0
    info = json.loads((out / "diffcurr_fast.json").read_text())
    assert info["formulation"] == "ddpm" and info["weights"] == "ema"
    fresh = build_model(cfg)
    load_init_weights(fresh, out)  # the transformer/ folder of an export
    load_init_weights(fresh, out / "transformer")
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # a training run fine-tunes from it: its first checkpoint starts from these weights
    cfg2 = load_config(
        None,
        tiny_dit_overrides(
            tmp_path / "ft",
            *digits,
            f"model.init_from={out}",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
        ),
    )
    from diffcurr_fast.train.loop import Trainer

    tr = Trainer(cfg2)
    for k, v in model.state_dict().items():
        assert torch.equal(tr.model.state_dict()[k].cpu(), v), k


def test_init_from_diffusers_mismatch_and_split_embedders(tmp_path):
    path, cfg, model = _checkpoint(tmp_path)
    out = tmp_path / "export"
    export_diffusers(str(path), out)
    other = build_model(load_config(None, tiny_dit_overrides(tmp_path / "x", "model.depth=3")))
    with pytest.raises(ValueError, match="does not fit the model: 10 missing keys: blocks.2.attn.qkv"):
        load_init_weights(other, out)
    # a diffusers model whose blocks' embedder copies were trained apart has no release counterpart
    net = diffusers.DiTTransformer2DModel.from_pretrained(out / "transformer")
    with torch.no_grad():
        net.transformer_blocks[1].norm1.emb.timestep_embedder.linear_1.bias.add_(1.0)
    net.save_pretrained(out / "transformer")
    with pytest.raises(ValueError, match="transformer_blocks.1.norm1.emb.timestep_embedder.linear_1.bias differs"):
        load_init_weights(build_model(cfg), out)


def test_export_refuses_existing_out_and_non_exports(tmp_path, capsys):
    path, _, _ = _checkpoint(tmp_path)
    out = tmp_path / "export"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert cli.main(["export", str(path), "--to", "diffusers", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert cli.main(["export", str(path), "--to", "diffusers", str(out), "--overwrite"]) == 2
    assert "is not a diffusers export" in capsys.readouterr().err and (out / "mine.txt").read_text() == "keep"
    fresh = tmp_path / "fresh"
    assert cli.main(["export", str(path), "--to", "diffusers", str(fresh)]) == 0
    stamp = (fresh / "transformer" / "config.json").stat().st_mtime_ns
    assert cli.main(["export", str(path), "--to", "diffusers", str(fresh), "--overwrite"]) == 0
    assert (fresh / "transformer" / "config.json").stat().st_mtime_ns >= stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fresh.")]  # no temporary left behind


_MODERN = r"^this DiT cannot be written as a diffusers DiTTransformer2DModel: it uses the modern block \({}\), which "


@pytest.mark.parametrize(
    "extra, match",
    [
        (("model.dtr=true",), "Denoising Task Routing"),
        (
            ("model.routing=sprint", "model.routing_start=0", "model.routing_end=1"),
            r"it uses SPRINT \(model.routing=sprint\), whose fusion layer and \[MASK\] token",
        ),
        (("model.mlp_ratio=3.0",), "mlp_ratio is 3.0"),
        (("model.norm=rmsnorm",), _MODERN.format("model.norm=rmsnorm")),
        (("model.qk_norm=true",), _MODERN.format("model.qk_norm=true")),
        (("model.mlp=swiglu",), _MODERN.format("model.mlp=swiglu")),
        (("model.pos=rope2d",), _MODERN.format("model.pos=rope2d")),
        (
            ("model.norm=rmsnorm", "model.qk_norm=true", "model.mlp=swiglu", "model.pos=rope2d"),
            _MODERN.format("model.norm=rmsnorm, model.qk_norm=true, model.mlp=swiglu, model.pos=rope2d"),
        ),
    ],
)
def test_export_refuses_what_diffusers_cannot_hold(tmp_path, extra, match):
    path, _, _ = _checkpoint(tmp_path, *extra)
    with pytest.raises(ValueError, match=match) as info:
        export_diffusers(str(path), tmp_path / "out")
    assert "\n" not in str(info.value)  # one line
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_a_tread_model_exports(tmp_path):
    """TREAD adds no parameters: its model is written as the plain one (SPRINT's is refused above)."""
    path, _, _ = _checkpoint(tmp_path, "model.routing=tread", "model.routing_start=0", "model.routing_end=1")
    export_diffusers(str(path), tmp_path / "out")
    assert (tmp_path / "out" / "transformer" / "config.json").is_file()


def test_flow_export_euler_loop_equals_flow_sample(tmp_path):
    """Flow: the same interpolant as diffusers' flow matching (sigma = t); the transformer takes t = sigma."""
    path, cfg, model = _checkpoint(tmp_path, "diffusion.formulation=flow", std=0.02)
    out = tmp_path / "flow"
    export_diffusers(str(path), out)
    net = diffusers.DiTTransformer2DModel.from_pretrained(out / "transformer").eval()
    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(out / "scheduler")
    steps, labels = 8, torch.tensor([2, 4, 6])
    noise = torch.randn(3, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    sched.set_timesteps(sigmas=torch.linspace(1, 0, steps + 1)[:-1].tolist())
    x = noise.clone()
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            sigma = sched.sigmas[i].expand(3)
            x = sched.step(net(x, timestep=sigma, class_labels=labels).sample, t, x).prev_sample
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        from diffusers.models.embeddings import get_timestep_embedding

        mp.setattr(
            dit_module.TimestepEmbedder,
            "timestep_embedding",
            staticmethod(
                lambda t, dim, max_period=10000, dtype=torch.float32: get_timestep_embedding(
                    t, dim, flip_sin_to_cos=True, downscale_freq_shift=1
                ).to(dtype)
            ),
        )
        ours = flow_sample(model, (3, 1, 6, 6), labels, num_steps=steps, method="euler", noise=noise)
    assert_near_reference(ours, x, 1e-5, "ours against diffusers")  # scaled: samples reach about 24


def test_edm_export_euler_loop_equals_our_edm_euler(tmp_path, diffusers_time):
    """EDM: ``EDMEulerScheduler`` preconditions as EDM Table 1 (c_in, c_skip, c_out, c_noise) on the same Karras
    grid; started from noise * sigma_max as EDM Alg. 1 (diffusers' ``init_noise_sigma`` is sqrt(sigma_max^2 + 1))."""
    path, cfg, model = _checkpoint(tmp_path, "diffusion.formulation=edm", "diffusion.sigma_max=20.0", std=0.02)
    name, conf = scheduler_config(cfg)
    assert name == "EDMEulerScheduler" and conf["sigma_max"] == 20.0 and conf["sigma_data"] == 0.5
    out = tmp_path / "edm"
    export_diffusers(str(path), out)
    net = diffusers.DiTTransformer2DModel.from_pretrained(out / "transformer").eval()
    sched = diffusers.EDMEulerScheduler.from_pretrained(out / "scheduler")
    steps, labels, seed = 7, torch.tensor([1, 3, 5]), 4
    sched.set_timesteps(steps)
    noise = torch.randn(3, 1, 6, 6, generator=make_generator(seed))  # our sampler's first draw
    x = noise * sched.sigmas[0]
    with torch.no_grad():
        for t in sched.timesteps:
            inp = sched.scale_model_input(x, t)
            x = sched.step(net(inp, timestep=t.expand(3), class_labels=labels).sample, t, x).prev_sample
        ours = sample(
            model,
            build_schedule(cfg),
            sampler="euler",
            steps=steps,
            labels=labels,
            channels=1,
            size=6,
            num_classes=7,
            readout=Readout("x0"),
            seed=seed,
        )
    assert_near_reference(ours, x, 1e-5, "ours against diffusers")  # scaled: samples reach about 24


def test_edm_export_has_no_pipeline(tmp_path):
    path, _, _ = _checkpoint(tmp_path, "diffusion.formulation=edm")
    with pytest.raises(ValueError, match="DiTPipeline runs DDPM models only; an edm model is written as"):
        export_diffusers(str(path), tmp_path / "edm2", vae=str(tmp_path))


def test_export_refuses_a_pruned_expert_with_its_reason(tmp_path):
    """A TDC expert (per-block widths in the checkpoint's model_config) gets the reason, not a size mismatch."""
    from diffcurr_fast.tdc.prune import prune_dit

    path, cfg, model = _checkpoint(tmp_path)
    pruned = prune_dit(model, [torch.tensor([0, 2]), torch.tensor([1])], [torch.arange(0, 192, 2), torch.arange(5)])
    sd = pruned.state_dict()
    state = {"config": cfg.to_dict(), "model_config": pruned.config(), "model": sd, "ema": {"module": sd}, "step": 1}
    atomic_save(state, path)
    with pytest.raises(ValueError, match=r"^this DiT cannot be written .*: it is pruned \(per-block heads or MLP"):
        export_diffusers(str(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dataset", ["digits", "mnist5k", "images"])
def test_export_refuses_a_vae_for_every_pixel_dataset(tmp_path, vae_dir, dataset):
    path_set = ["data.path=x"] if dataset == "images" else []  # the built-in datasets read no file
    path, _, _ = _checkpoint(tmp_path, f"data.dataset={dataset}", "model.in_channels=3", *path_set)
    with pytest.raises(
        ValueError, match=rf"^--vae is for latent models; this one was trained on pixels \('{dataset}'\)$"
    ):
        export_diffusers(str(path), tmp_path / "out", vae=str(vae_dir))
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_vae_whose_latents_do_not_fit(tmp_path, vae_dir):
    """npz arrays may hold latents or pixels: the VAE's latent channels decide (the tiny VAE makes 4)."""
    path, _, _ = _checkpoint(tmp_path, "data.dataset=npz", "data.path=x.npz", "model.in_channels=3")
    with pytest.raises(ValueError, match=r"makes 4-channel latents, but this model takes 3 channels"):
        export_diffusers(str(path), tmp_path / "out", vae=str(vae_dir))
    with pytest.raises(ValueError, match=r"is not a diffusers AutoencoderKL directory"):
        export_diffusers(str(path), tmp_path / "out", vae=str(tmp_path))


def test_init_from_refuses_to_drop_a_trained_null_label_row(tmp_path):
    """A model trained with label dropout has a trained null-label row; a model without label dropout has no place
    for it: refused in one line (never dropped silently). The all-zero row of a no-dropout export is dropped."""
    path, cfg, model = _checkpoint(tmp_path)  # label dropout 0.1: 7 classes + the null row
    export_diffusers(str(path), tmp_path / "export")
    plain = build_model(load_config(None, tiny_dit_overrides(tmp_path / "x", "model.class_dropout_prob=0.0")))
    with pytest.raises(ValueError, match=r"has a trained null-label row .* set model.class_dropout_prob > 0"):
        load_init_weights(plain, tmp_path / "export")
    path2, cfg2, model2 = _checkpoint(tmp_path / "nodrop", "model.class_dropout_prob=0.0")
    export_diffusers(str(path2), tmp_path / "export2")
    load_init_weights(plain, tmp_path / "export2")
    assert torch.equal(plain.y_embedder.embedding_table.weight, model2.y_embedder.embedding_table.weight)


def test_export_checks_out_and_weights_in_one_line(tmp_path, capsys, monkeypatch):
    """OUT where nothing can be created is refused before the checkpoint is read; weights that do not fit the
    checkpoint's own config, and a corrupt newest checkpoint of a run, are one line each (the second naming the
    earlier intact checkpoint)."""
    from diffcurr_fast import _files, cli_export
    from diffcurr_fast.runs import checkpoint

    path, cfg, model = _checkpoint(tmp_path)

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as mp:
        mp.setattr(_files.tempfile, "mkdtemp", refuse)
        mp.setattr(cli_export, "load_model", lambda *a: pytest.fail("the checkpoint was read"))
        assert cli.main(["export", str(path), "--to", "diffusers", str(tmp_path / "ro" / "out")]) == 2
        err = capsys.readouterr().err
        assert "OUT" in err and "cannot be written" in err and "refuses new files (Permission denied)" in err, err
    assert not (tmp_path / "ro").exists()

    state = checkpoint.load_checkpoint(path)
    state["config"]["model"]["depth"] = 3  # the weights are of depth 2
    torch.save(state, tmp_path / "deeper.pt")
    assert cli.main(["export", str(tmp_path / "deeper.pt"), "--to", "diffusers", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'blocks.2.attn.qkv.weight' is missing from the weights" in err, err
    assert f"checkpoint '{tmp_path / 'deeper.pt'}' (ema weights): the weights do not match" in err

    checkpoint.atomic_save(state | {"config": cfg.to_dict()}, path.with_name("ckpt_00000002.pt"))
    path.with_name("ckpt_00000002.pt").write_bytes(b"PK\x03\x04 truncated")
    assert cli.main(["export", str(tmp_path / "run"), "--to", "diffusers", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert f"the earlier checkpoint '{path}' of the run is intact: pass that file instead" in err, err
    assert cli.main(["export", str(path), "--to", "diffusers", str(tmp_path / "b")]) == 0  # the advice works
