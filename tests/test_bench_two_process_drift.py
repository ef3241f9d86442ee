"""bench/two_process_drift.py: where a run first parts from another, and its runs end to end."""

from __future__ import annotations

import json

import pytest
import torch

from aiayn.checkpoint import load_checkpoint
from bench import two_process_drift as drift
from bench.two_process_drift import Record


def records(*rows: tuple) -> list[Record]:
    return [Record(*row) for row in rows]


def test_digest_tells_tensors_apart_bit_for_bit():
    x = torch.tensor([1.0, 2.0, 3.0])
    y = x.clone()
    y[1] = torch.nextafter(y[1], torch.tensor(3.0))  # one ulp
    assert drift.digest(x) == drift.digest(x.clone())
    assert drift.digest(x) != drift.digest(y)
    assert drift.digest(torch.tensor(0.0)) != drift.digest(torch.tensor(-0.0))
    assert drift.digest(x[::2]) == drift.digest(torch.tensor([1.0, 3.0]))  # a view's values
    assert drift.digest(torch.tensor([1, 2])) != drift.digest(torch.tensor([2, 1]))
    half = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert drift.digest(half) == drift.digest(half.clone())
    assert drift.digest(half) != drift.digest(half.float())  # other bytes, same values


def test_first_parting_names_the_first_record_that_differs():
    a = records((1, 0, "input", "src", "aa"), (1, 0, "loss", "loss", "bb"),
                (1, 0, "local", "w", "cc"), (2, 0, "loss", "loss", "dd"))
    assert drift.first_parting(a, list(a)) is None
    b = [*a[:2], Record(1, 0, "local", "w", "xx"), Record(2, 0, "loss", "loss", "yy")]
    assert drift.first_parting(a, b) == Record(1, 0, "local", "w", "xx")
    # A run that stopped early (or went on) parts where the shorter one ends.
    assert drift.first_parting(a, a[:3]) == a[3]
    assert drift.first_parting(a[:3], a) == a[3]


def test_earliest_takes_the_lowest_step_then_rank():
    r = [Record(7, 0, "local", "w", "x"), Record(5, 1, "loss", "loss", "y"),
         Record(5, 0, "param", "w", "z")]
    assert drift.earliest(r) == Record(5, 0, "param", "w", "z")
    assert drift.earliest([]) is None


def test_read_records_round_trips_what_a_worker_writes(tmp_path):
    path = tmp_path / "records.1"
    path.write_text("3\t1\tlocal\tdecoder.0.norm.weight\t0123456789ab\n"
                    "3\t1\treduced\tdecoder.0.norm.weight\tba9876543210\n")
    assert drift.read_records(path) == records(
        (3, 1, "local", "decoder.0.norm.weight", "0123456789ab"),
        (3, 1, "reduced", "decoder.0.norm.weight", "ba9876543210"))


def test_a_malformed_env_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        drift.main(["--env", "AIAYN_CPU_EXTENSION", "--runs", "2"])
    assert e.value.code == 2
    assert "--env 'AIAYN_CPU_EXTENSION': give NAME=VALUE" in capsys.readouterr().err


def test_kernel_calls_are_recorded_inputs_before_outputs_after(monkeypatch):
    """--kernels: each call into the C++ module writes its tensor inputs, then its results
    and its arguments again; arguments a kernel only writes are not read as inputs."""
    from aiayn import kernels

    if kernels.cpu_extension() is None:
        pytest.skip("the C++ CPU kernels did not build here")
    monkeypatch.setattr(kernels, "_extension", kernels._extension)  # restored afterwards
    written = []
    drift.record_kernels(lambda kind, name, t: written.append((kind, name, drift.digest(t))))
    x, out = torch.randn(6, 8), torch.randn(6, 8)
    w, b = torch.ones(8), torch.zeros(8)
    y, mask = kernels.residual_norm(x, out, w, b, 0.1, seed=5, return_mask=True)
    names = [(kind, name) for kind, name, _ in written]
    assert names[:5] == [("kernel-in", f"forward#1.arg{i}") for i in (0, 1, 2, 3, 7)]
    assert names[5:9] == [("kernel-out", f"forward#1.result{i}") for i in range(4)]
    assert written[0][2] == drift.digest(x) and written[1][2] == drift.digest(out)
    assert written[5][2] == drift.digest(y) and written[7][2] == drift.digest(mask)
    written.clear()
    logits = torch.randn(3, 16)
    loss, nll = torch.empty(3), torch.empty(3)
    kernels.cpu_extension().label_smoothed_softmax_(
        logits, torch.tensor([1, 2, 3]), logits.mean(1), loss, nll, 16, 0.1, True)
    assert {kind for kind, _, _ in written} == set(drift.KERNEL_KINDS)
    ins = [name for kind, name, _ in written if kind == "kernel-in"]
    outs = [name for kind, name, _ in written if kind == "kernel-out"]
    assert ins == [f"label_smoothed_softmax_#2.arg{i}" for i in (0, 1, 2)]
    assert outs == [f"label_smoothed_softmax_#2.arg{i}" for i in range(5)]
    assert dict((n, d) for k, n, d in written if k == "kernel-out")[
        "label_smoothed_softmax_#2.arg3"] == drift.digest(loss)


@pytest.mark.slow
def test_two_runs_are_recorded_step_by_step_and_compared(tmp_path, capsys):
    """Two real torchrun runs of 4 steps: every kind of record at every step on both ranks,
    the same in both runs (without the C++ kernels, as the cluster tests run)."""
    out = drift.main(["--runs", "2", "--steps", "4", "--env", "AIAYN_CPU_EXTENSION=0",
                      "--workdir", str(tmp_path), "--keep", "--json",
                      str(tmp_path / "drift.json")])
    printed = capsys.readouterr().out
    assert "run 2: the same" in printed and "0 of 1 runs parted from run 1" in printed
    assert out["parted"] == 0 and out["compared"] == [{"run": 2, "parted": False}]
    assert json.loads((tmp_path / "drift.json").read_text())["env"] == {
        "AIAYN_CPU_EXTENSION": "0"}
    run = next(tmp_path.glob("runs-*/run1"))
    model = load_checkpoint(run / "checkpoints/step-00000004.pt")["model"]
    names = set(model)
    for rank in (0, 1):
        rec = drift.read_records(run / f"records.{rank}")
        assert {r.rank for r in rec} == {rank}
        assert sorted({r.step for r in rec}) == [1, 2, 3, 4]
        for step in (1, 4):
            kinds = {r.kind for r in rec if r.step == step}
            assert kinds == set(drift.KINDS)
            for kind in ("local", "reduced", "param"):
                assert {r.name for r in rec if r.step == step and r.kind == kind} == names
    # The last step's weights as recorded are those of the checkpoint.
    last = {r.name: r.digest for r in drift.read_records(run / "records.0")
            if r.step == 4 and r.kind == "param"}
    assert last == {name: drift.digest(t) for name, t in model.items()}


@pytest.mark.slow
def test_kernels_adds_each_kernel_calls_records_to_every_step(tmp_path, capsys):
    """--kernels on two real runs of 2 steps with the C++ kernels: the kernel calls' records
    beside the others at every step, in a forward call's order (inputs, then outputs), and
    identical between the runs."""
    from aiayn import kernels

    if kernels.cpu_extension() is None:
        pytest.skip("the C++ CPU kernels did not build here")
    out = drift.main(["--runs", "2", "--steps", "2", "--kernels", "--workdir", str(tmp_path),
                      "--keep"])
    assert "0 of 1 runs parted from run 1" in capsys.readouterr().out and out["kernels"]
    rec = drift.read_records(next(tmp_path.glob("runs-*/run1")) / "records.0")
    for step in (1, 2):
        assert {r.kind for r in rec if r.step == step} == {*drift.KINDS, *drift.KERNEL_KINDS}
    first = [r for r in rec if r.name.startswith("forward#")][:9]  # a residual block's call
    assert [r.kind for r in first] == ["kernel-in"] * 5 + ["kernel-out"] * 4
