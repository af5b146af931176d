"""Try every technique on HF architectures beyond the matrix (tiny configs, random init,
no downloads): the table "Other architectures, tried" in docs/models.md.

    python tests/models/try_architectures.py [NAMES|all] [CHECKS]

``NAMES``: comma-separated keys of ``ARCHS``; ``CHECKS``: ``unit``, ``float8``,
``scalify-fp16``, ``scalify-fp8``, ``prepare:RECIPE`` (default: those and three recipes).
One line per case (the numbers, or the exception), then the WARNINGs it logged. Not a test
(pytest collects no ``test_`` name here): the matrix (test_matrix.py) is the CI check.
"""

import copy
import logging
import math
import sys
import traceback

import pytest
import torch
from torch import nn

from lowprec.float8 import Float8Linear, convert_to_float8
from lowprec.jobs.hf_models import CausalLM
from lowprec.recipes import prepare
from lowprec.recipes.step import Plain, train_step

tf = pytest.importorskip("transformers")  # collected by --doctest-modules: skipped without it

V, W, D, H, S, B = 48, 32, 2, 4, 16, 4


class MLM(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.model = m

    @property
    def dummy_inputs(self):
        return {"idx": torch.zeros(2, S, dtype=torch.long)}

    def forward(self, idx, targets=None):
        logits = self.model(input_ids=idx).logits
        loss = (
            None
            if targets is None
            else nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        )
        return logits, loss


class Seq2Seq(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.model = m

    @property
    def dummy_inputs(self):
        return {"idx": torch.zeros(2, S, dtype=torch.long)}

    def forward(self, idx, targets=None):
        logits = self.model(input_ids=idx, decoder_input_ids=idx).logits
        loss = (
            None
            if targets is None
            else nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        )
        return logits, loss


common = dict(
    vocab_size=V,
    hidden_size=W,
    num_hidden_layers=D,
    num_attention_heads=H,
    intermediate_size=4 * W,
    max_position_embeddings=S,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def C(cfg, model, wrap=CausalLM, **kw):
    def build():
        c = getattr(tf, cfg)(**kw)
        m = getattr(tf, model)(c)
        return wrap(m, S) if wrap is CausalLM else wrap(m)

    return build


ARCHS = {
    "mistral": C(
        "MistralConfig",
        "MistralForCausalLM",
        **common,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "phi": C("PhiConfig", "PhiForCausalLM", **common),
    "phi3": C(
        "Phi3Config", "Phi3ForCausalLM", **common, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "gemma": C("GemmaConfig", "GemmaForCausalLM", **common, num_key_value_heads=2, head_dim=8),
    "gemma2": C(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        **common,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=8,
    ),
    "opt": C(
        "OPTConfig",
        "OPTForCausalLM",
        vocab_size=V,
        hidden_size=W,
        num_hidden_layers=D,
        num_attention_heads=H,
        ffn_dim=4 * W,
        word_embed_proj_dim=W,
        max_position_embeddings=S,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=1,
    ),
    "falcon": C(
        "FalconConfig",
        "FalconForCausalLM",
        vocab_size=V,
        hidden_size=W,
        num_hidden_layers=D,
        num_attention_heads=H,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "gptj": C(
        "GPTJConfig",
        "GPTJForCausalLM",
        vocab_size=V,
        n_embd=W,
        n_layer=D,
        n_head=H,
        rotary_dim=4,
        n_positions=S,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "bloom": C(
        "BloomConfig",
        "BloomForCausalLM",
        vocab_size=V,
        hidden_size=W,
        n_layer=D,
        n_head=H,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "stablelm": C("StableLmConfig", "StableLmForCausalLM", **common, num_key_value_heads=2),
    "olmo": C("OlmoConfig", "OlmoForCausalLM", **common),
    "olmo2": C("Olmo2Config", "Olmo2ForCausalLM", **common),
    "qwen3": C("Qwen3Config", "Qwen3ForCausalLM", **common, num_key_value_heads=2, head_dim=8),
    "bert": C(
        "BertConfig",
        "BertForMaskedLM",
        MLM,
        vocab_size=V,
        hidden_size=W,
        num_hidden_layers=D,
        num_attention_heads=H,
        intermediate_size=4 * W,
        max_position_embeddings=S,
        pad_token_id=0,
    ),
    "roberta": C(
        "RobertaConfig",
        "RobertaForMaskedLM",
        MLM,
        vocab_size=V,
        hidden_size=W,
        num_hidden_layers=D,
        num_attention_heads=H,
        intermediate_size=4 * W,
        max_position_embeddings=S + 2,
        pad_token_id=0,
    ),
    "t5": C(
        "T5Config",
        "T5ForConditionalGeneration",
        Seq2Seq,
        vocab_size=V,
        d_model=W,
        d_ff=4 * W,
        d_kv=8,
        num_layers=D,
        num_heads=H,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=None,
    ),
}


def batch():
    g = torch.Generator().manual_seed(1)
    s = torch.randint(1, V, (B, S + 1), generator=g)
    return s[:, :-1], s[:, 1:]


def train(run, steps=4, lr=None):
    x, y = batch()
    L = []
    for _ in range(steps):
        r = train_step(run, x, y, lr)
        L.append(round(float(r.loss.detach()), 4))
        if r.skipped:
            return L, "skipped"
    ok = all(math.isfinite(v) for v in L) and L[-1] < L[0]
    return L, "OK" if ok else "FAIL"


def layers(model):
    f = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == D]
    return f[0]


@torch.no_grad()
def stds(model):
    out = []

    def hook(m, a, o):
        h = o[0] if isinstance(o, (tuple, list)) else o
        out.append(round(float(h.float().std()), 3))

    hs = [layer.register_forward_hook(hook) for layer in layers(model)]
    try:
        model(*batch())
    finally:
        for h in hs:
            h.remove()
    return out


class Cap(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.msgs = []

    def emit(self, r):
        self.msgs.append(r.getMessage()[:400])


cap = Cap()


def mk(name):
    torch.manual_seed(0)
    return ARCHS[name]().train()


def run(name, what):
    cap.msgs.clear()
    try:
        if what == "unit":
            from lowprec.unit import umup_param_groups, unit_scale

            m = mk(name)
            x, y = batch()
            u = unit_scale(m, reinit=True, example_inputs=(x, y))
            st = stds(u)
            r = train(Plain(u, torch.optim.AdamW(umup_param_groups(u, lr=2**-4))))
            return f"stds={st} {r}"
        if what == "float8":
            m = mk(name)
            n_lin = sum(
                isinstance(q, nn.Linear) or type(q).__name__ == "Conv1D" for q in m.modules()
            )
            m = convert_to_float8(m, "tensorwise")
            n8 = sum(isinstance(q, Float8Linear) for q in m.modules())
            r = train(Plain(m, torch.optim.AdamW(m.parameters(), lr=1e-2)))
            return f"linear-like={n_lin} converted={n8} {r}"
        if what.startswith("scalify"):
            from lowprec.scalify import coverage, reset_coverage, scalify

            fmt = what.split("-")[1]
            m = mk(name).eval()
            ref = copy.deepcopy(m)
            x, y = batch()
            ref(x, y)[1].backward()
            reset_coverage()
            sm = scalify(m, fmt)
            sm(x, y)[1].backward()
            g = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            got = dict(m.named_parameters())
            miss = [n for n in g if got[n].grad is None]
            tot = torch.cat([v.flatten() for v in g.values()]).norm()
            err = torch.cat(
                [(got[n].grad - v).flatten() for n, v in g.items() if got[n].grad is not None]
            ).norm()
            worst = max(
                (
                    (float((got[n].grad - v).norm()) / max(float(v.norm()), 1e-3 * float(tot)), n)
                    for n, v in g.items()
                    if got[n].grad is not None
                )
            )
            fb = coverage().fallbacks
            m.train()
            r = train(Plain(sm, torch.optim.AdamW(m.parameters(), lr=1e-2)))
            head = f"rel={float(err / tot):.2e} worst={worst[0]:.2e} {worst[1]}"
            return f"{head} miss={miss[:3]} fallbacks={dict(fb)} {r}"
        if what.startswith("prepare"):
            rec = what.split(":")[1]
            run_ = prepare(mk(name), rec, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
            return str(train(run_))
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        return (
            "EXC "
            + type(e).__name__
            + ": "
            + str(e)[:300]
            + " @ "
            + " | ".join(line.strip() for line in tb[-6:-1:2])
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    logging.getLogger("lowprec").addHandler(cap)
    names = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] != "all" else list(ARCHS)
    whats = (
        sys.argv[2].split(",")
        if len(sys.argv) > 2
        else [
            "unit",
            "float8",
            "scalify-fp16",
            "scalify-fp8",
            "prepare:fp8-delayed",
            "prepare:fp16-unit",
            "prepare:bf16",
        ]
    )
    for n in names:
        for w in whats:
            res = run(n, w)
            print(f"{n:9s} {w:18s} {res}", flush=True)
            for msg in cap.msgs:
                print("      WARN:", msg.replace("\n", " "), flush=True)
