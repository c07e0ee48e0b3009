"""`jetrl train` with ``model.numerics: vllm-cpu`` says which vLLM CPU kernels it matches, and says so
loudly when it cannot (never a silent "matched")."""

from __future__ import annotations

from jetrl.rollout.engine_match import VllmCpuPath
from jetrl.train.trainer import Trainer


class _Engine:
    def __init__(self, isas):
        self.isas = isas

    def cpu_attention_isas(self):
        return self.isas


def _trainer(path, isas):
    t = Trainer.__new__(Trainer)  # only the start-up check, without a model or an engine
    t.numerics_path, t.engine, t.lines = path, _Engine(isas), []
    t.log = t.lines.append
    return t


def test_matched_path_is_stated():
    t = _trainer(VllmCpuPath("_C_AVX2", "vec", "toward-zero", True), {"vec"})
    t._check_numerics_path()
    assert t.lines == ["trainer numerics: vllm-cpu _C_AVX2 kernels, attention vec, bf16 toward-zero (matched)"]


def test_unreproduced_path_is_a_warning_naming_the_op():
    why = "vLLM's AMX attention and sgl-kernel BF16 GEMMs (lm_head) are not reproduced"
    t = _trainer(VllmCpuPath("_C", "amx", "nearest-even", False, why), {"amx"})
    t._check_numerics_path()
    assert "NOT matched" in t.lines[0] and "AMX attention" in t.lines[0]
    assert t.lines[1].startswith("WARNING: model.numerics='vllm-cpu' cannot reproduce") and why in t.lines[1]


def test_live_engine_attention_other_than_predicted_unmatches():
    t = _trainer(VllmCpuPath("_C", "vec", "nearest-even", True), {"vec16"})
    t._check_numerics_path()
    assert not t.numerics_path.matched and "['vec16']" in t.numerics_path.reason
    assert t.lines[1].startswith("WARNING")
