"""Atomic JSON files: a failed write leaves the previous file whole."""

import json
import os

import pytest

from diffcurr_fast import _files
from diffcurr_fast._files import write_json


def test_write_json_replaces_whole_and_a_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "status.json"
    assert write_json({"a": 1}, path, indent=1) == path  # parents created
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json({"b": object()}, path)  # not JSON: nothing written
    assert json.loads(path.read_text()) == {"a": 1} and sorted(os.listdir(path.parent)) == ["status.json"]

    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(_files.os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        write_json({"c": 2}, path)
    assert json.loads(path.read_text()) == {"a": 1}  # the old file, whole


def test_a_truncated_safetensors_file_is_named_wherever_it_is_read(tmp_path):
    """init_from, a diffusers folder and a TDC bundle read a user's safetensors through one reader: a truncated,
    empty or foreign file is a ValueError that names it, never safetensors' own traceback."""
    import torch
    from safetensors.torch import save_file

    from diffcurr_fast._files import read_safetensors
    from diffcurr_fast.models.diffusers_dit import read_diffusers_dir
    from diffcurr_fast.tdc.experts import load_bundle
    from diffcurr_fast.train.data import load_init_weights

    good = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6.0)}, str(good))
    assert torch.equal(read_safetensors(good)["a"], torch.arange(6.0))
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(good.read_bytes()[:-5])
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    for path in (bad, empty):
        with pytest.raises(ValueError, match=rf"^'{path}' is not a readable safetensors file \(.*\); it may be trunc"):
            read_safetensors(path)
    with pytest.raises(ValueError, match="cut.safetensors' is not a readable safetensors file"):
        load_init_weights(torch.nn.Linear(2, 3), bad)
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "DiTTransformer2DModel"}))
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(bad.read_bytes())
    with pytest.raises(ValueError, match="diffusion_pytorch_model.safetensors' is not a readable safetensors file"):
        read_diffusers_dir(folder)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text(json.dumps({"format": "diffcurr_fast.tdc.bundle/1", "experts": []}))
    (bundle / "weights.safetensors").write_bytes(bad.read_bytes())
    with pytest.raises(ValueError, match="weights.safetensors' is not a readable safetensors file"):
        load_bundle(bundle)


def test_check_writable_names_the_part_of_the_path_that_refuses(tmp_path, monkeypatch):
    from diffcurr_fast._files import check_writable

    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    check_writable(tmp_path / "new" / "deeper" / "out.png", "--out", "choose another --out")  # created later
    check_writable(tmp_path / "afile", "--out", "fix")  # an existing file: replaced (the caller asks --overwrite)
    with pytest.raises(ValueError, match=r"^--out '.*afile/x.png' cannot be created: '.*afile' is a file, not a dir"):
        check_writable(tmp_path / "afile" / "x.png", "--out", "choose another --out")
    with pytest.raises(ValueError, match=r"^--json '.*adir' is a folder, not a file; choose another --json$"):
        check_writable(tmp_path / "adir", "--json", "choose another --json")
    check_writable(tmp_path / "adir", "--to", "fix", directory=True)
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match="is a broken link; fix"):
        check_writable(tmp_path / "link" / "x.npz", "--out", "fix")

    def refuse(prefix, dir):  # root passes every permission check: a read-only folder is simulated
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_files.tempfile, "mkdtemp", refuse)
    with pytest.raises(ValueError, match=r"cannot be written: '.*adir' refuses new files \(Permission denied\); fix"):
        check_writable(tmp_path / "adir" / "s.png", "--out", "fix")


def test_read_json_names_the_file_line_and_column(tmp_path):
    from diffcurr_fast._files import read_json

    p = tmp_path / "ds.json"
    p.write_text('{"a": 1,,}')
    with pytest.raises(ValueError, match=r"^DeepSpeed config '.*ds.json' is not valid JSON \(line 1, column 9: "):
        read_json(p, "DeepSpeed config")
    p.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="is not a JSON text file"):
        read_json(p)
    p.write_text('{"a": [1, 2]}')
    assert read_json(p) == {"a": [1, 2]}


def test_load_npz_names_the_file_and_never_advises_pickles(tmp_path):
    import numpy as np

    from diffcurr_fast._files import load_npz

    ok = tmp_path / "ok.npz"
    np.savez(ok, x=np.arange(6).reshape(2, 3), y=np.arange(2))
    assert set(load_npz(ok)) == {"x", "y"} and load_npz(ok, keys=("y",))["y"].tolist() == [0, 1]
    data = ok.read_bytes()
    cases = {
        "trunc.npz": (data[: len(data) // 2], "may be truncated or of another format"),
        "text.npz": (b"not an archive", "not a numpy archive, or one holding pickled objects"),
        "empty.npz": (b"", "may be truncated or of another format"),
    }
    for name, (content, why) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"^--samples '.*{name}' is not a readable .npz file.*{why}") as e:
            load_npz(tmp_path / name, "--samples")
        assert "allow_pickle" not in str(e.value)
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="pickled objects, which are not read"):
        load_npz(tmp_path / "obj.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ValueError, match="is a single .npy array, not an .npz archive"):
        load_npz(tmp_path / "one.npy")
    with pytest.raises(ValueError, match=r"has no 'images' array \(it holds \['x', 'y'\]\)"):
        load_npz(ok, "--samples", keys=("images",))
    with pytest.raises(FileNotFoundError, match="'.*nope.npz' does not exist"):
        load_npz(tmp_path / "nope.npz")


def test_cli_errors_are_one_line_once_and_ctrl_c_is_130(monkeypatch, capsys):
    from diffcurr_fast import cli

    def boom(args):
        raise PermissionError(13, "Permission denied", "/ro/out.png")

    def interrupt(args):
        raise KeyboardInterrupt

    mod = type("M", (), {"add_arguments": staticmethod(lambda p: None), "run": staticmethod(boom)})
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: mod)
    assert cli.main(["info"]) == 2
    assert capsys.readouterr().err == "diffcurr-fast info: error: Permission denied: '/ro/out.png'\n"
    monkeypatch.setenv("RANK", "1")  # under a launcher only rank 0 prints
    assert cli.main(["info"]) == 2 and capsys.readouterr().err == ""
    monkeypatch.delenv("RANK")
    mod.run = staticmethod(interrupt)
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err.strip() == "diffcurr-fast info: interrupted (Ctrl-C)"


def test_output_lock_refuses_a_second_holder_and_takes_over_a_stale_one(tmp_path):
    """The lock of an output: a second process is refused in one line naming the holder; within one process a
    second lock is a no-op; release removes the lock file and the folders it created; a lock file left by a process
    that is gone is taken over with a warning."""
    from conftest import locked_by_another

    from diffcurr_fast._files import LOCK_NAME, OutputLock

    run, out = tmp_path / "a" / "b" / "run", tmp_path / "s.png"
    with locked_by_another(run) as proc, locked_by_another(out, "file"):
        assert (run / LOCK_NAME).read_text().startswith(f"process {proc.pid}: ")
        with pytest.raises(ValueError, match=rf"^run directory '{run}' is in use by another command \(process "):
            OutputLock(run, "run directory", "choose another", directory=True).acquire()
        with pytest.raises(ValueError, match=r"^--out '.*s\.png' is in use by another command \(process \d+"):
            OutputLock(out, "--out", "choose another --out").acquire()
        assert (tmp_path / ".s.png.lock").is_file()
    with pytest.warns(UserWarning, match=rf"taking over the lock left by a process that is gone \(process {proc.pid}"):
        lock = OutputLock(run, "run directory", "choose another", directory=True).acquire()
    inner = OutputLock(run, "run directory", "choose another", directory=True).acquire()  # this process: no-op
    assert lock.held and not inner.held
    inner.release()
    assert (run / LOCK_NAME).is_file()
    lock.release()
    assert not (run / LOCK_NAME).exists() and run.is_dir()  # a folder it did not create stays
    fresh = tmp_path / "x" / "y"
    with OutputLock(fresh, "run directory", "choose another", directory=True):
        assert (fresh / LOCK_NAME).is_file()
    assert not (tmp_path / "x").exists()  # created for the lock, nothing written: removed
    with OutputLock(fresh, "run directory", "choose another", directory=True):
        (fresh / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in fresh.iterdir()) == ["metrics.jsonl"]
    with OutputLock(tmp_path / "none", "run directory", "x", directory=True, create=False) as absent:
        assert not absent.held and not (tmp_path / "none").exists()
    (tmp_path / "f").write_text("a file")
    with pytest.raises(ValueError, match=r"'.*f' is a file, not a directory; choose another"):
        OutputLock(tmp_path / "f" / "run", "run directory", "choose another", directory=True).acquire()


def test_every_command_that_writes_takes_the_lock(tmp_path, capsys, trained):
    """train, tdc, study, sample --out and extract-latents --out each take their output's lock before anything is
    written: while another command holds it, each is refused in one line and writes nothing."""
    import yaml
    from conftest import _main, locked_by_another

    from diffcurr_fast._files import LOCK_NAME

    vae = tmp_path / "vae"  # a VAE folder as the checks see it (the lock comes before it is loaded)
    vae.mkdir()
    (vae / "config.json").write_text('{"_class_name": "AutoencoderKL"}')
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "s", "seeds": [0], "eval_every": 1, "arms": [{"name": "a"}]}))
    out = tmp_path / "out"
    commands = {
        "train": ["train", "--run-dir", str(out), "--set", "engine.max_steps=1"],
        "tdc": ["tdc", "--run-dir", str(out)],
        "study": ["study", str(spec), "--out", str(out)],
        "extract-latents": ["extract-latents", "--vae", str(vae), "--data", str(tmp_path), "--out", str(out)],
    }
    with locked_by_another(out):
        for name, argv in commands.items():
            rc, err = _main(capsys, *argv)
            assert rc == 2 and f"'{out}' is in use by another command (process " in err, (name, err)
            assert len(err.strip().splitlines()) == 1 and os.listdir(out) == [LOCK_NAME], (name, err)
    png = tmp_path / "s.png"
    with locked_by_another(png, "file"):
        rc, err = _main(capsys, "sample", "--ckpt", str(trained), "--out", str(png), "--num-samples", "1")
    assert rc == 2 and f"--out '{png}' is in use by another command (process " in err and not png.exists(), err
