"""Tensor placement rules: -ngl, -ot (first match wins), --cpu-moe, --n-cpu-moe, errors."""
import pytest

from nbmoe.errors import NbmoeError
from nbmoe.sched.placement import moe_overrides, parse_overrides, place_tensors

BUF = ["CPU", "CUDA0", "CUDA1"]
N_LAYER = 4


def names():
    out = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(N_LAYER):
        out += [f"blk.{i}.attn_q.weight", f"blk.{i}.ffn_up_exps.weight", f"blk.{i}.ffn_gate_inp.weight"]
    return out


def where(**kw):
    return {n: b for n, (b, _) in place_tensors(names(), N_LAYER, **kw).items()}


def test_default_all_cpu():
    assert set(where().values()) == {"CPU"}


def test_ngl_all_keeps_embedding_in_ram():
    p = where(n_gpu_layers=99, devices=["CUDA0"])
    assert p["token_embd.weight"] == "CPU"
    assert all(b == "CUDA0" for n, b in p.items() if n != "token_embd.weight")


def test_ngl_counts_output_layer_first():
    p = where(n_gpu_layers=1, devices=["CUDA0"])
    assert p["output.weight"] == p["output_norm.weight"] == "CUDA0"
    assert p["blk.3.attn_q.weight"] == "CPU"
    p = where(n_gpu_layers=3, devices=["CUDA0"])     # output + layers 2, 3
    assert [p[f"blk.{i}.attn_q.weight"] for i in range(4)] == ["CPU", "CPU", "CUDA0", "CUDA0"]


def test_ngl_splits_layers_over_devices():
    p = where(n_gpu_layers=99, devices=["CUDA0", "CUDA1"])
    devs = [p[f"blk.{i}.attn_q.weight"] for i in range(4)] + [p["output.weight"]]
    assert devs == ["CUDA0", "CUDA0", "CUDA0", "CUDA1", "CUDA1"]


def test_override_first_match_wins_and_beats_ngl():
    ot = parse_overrides(["exps=CPU", "blk\\.1\\.ffn_up_exps=CUDA1"], BUF)
    p = where(n_gpu_layers=99, devices=["CUDA0"], overrides=ot)
    assert p["blk.1.ffn_up_exps.weight"] == "CPU"              # the first rule matched first
    assert p["blk.1.attn_q.weight"] == "CUDA0"
    ot = parse_overrides(["blk\\.1\\.ffn_up_exps=CUDA1,exps=CPU"], BUF)   # comma-separated
    p = where(n_gpu_layers=99, devices=["CUDA0"], overrides=ot)
    assert p["blk.1.ffn_up_exps.weight"] == "CUDA1" and p["blk.2.ffn_up_exps.weight"] == "CPU"


def test_override_moves_cpu_tensor_to_gpu():
    p = where(overrides=parse_overrides(["attn_q=CUDA0"], BUF))
    assert p["blk.0.attn_q.weight"] == "CUDA0" and p["blk.0.ffn_up_exps.weight"] == "CPU"


def test_cpu_moe_shorthands_come_after_user_overrides():
    ot = parse_overrides(["blk\\.0\\.ffn_up_exps=CUDA1"], BUF) + moe_overrides(cpu_moe=True)
    p = where(n_gpu_layers=99, devices=["CUDA0"], overrides=ot)
    assert p["blk.0.ffn_up_exps.weight"] == "CUDA1"
    assert p["blk.3.ffn_up_exps.weight"] == "CPU" and p["blk.3.ffn_gate_inp.weight"] == "CUDA0"
    p = where(n_gpu_layers=99, devices=["CUDA0"], overrides=moe_overrides(n_cpu_moe=2))
    assert [p[f"blk.{i}.ffn_up_exps.weight"] for i in range(4)] == ["CPU", "CPU", "CUDA0", "CUDA0"]


def test_causes_are_recorded():
    ot = parse_overrides(["exps=CPU"], BUF)
    p = place_tensors(names(), N_LAYER, 99, ot, ["CUDA0"])
    assert p["blk.0.ffn_up_exps.weight"][1] == "-ot exps=CPU"
    assert p["blk.0.attn_q.weight"][1] == "-ngl 99"


def test_errors():
    with pytest.raises(NbmoeError, match="unknown buffer type 'CUDA7'.*available: CPU, CUDA0, CUDA1"):
        parse_overrides(["exps=CUDA7"], BUF)
    with pytest.raises(NbmoeError, match="bad regex '\\(exps'"):
        parse_overrides(["(exps=CPU"], BUF)
    with pytest.raises(NbmoeError, match="REGEX=BUFTYPE"):
        parse_overrides(["exps"], BUF)
