"""``convert mcore-to-hf --verify --remote-code FILE``: the export loaded with a given upstream-style
modeling file under the installed transformers, its logits compared with the Megatron model's; a
file that does not load gives one line naming the transformers version problem (issue #42 item 7).

The modeling files are stand-ins written here (nothing is downloaded): LLaDA's forward in plain
torch under the upstream class and tensor names (an independent reference: it shares no code with
the converter or the Megatron model), once as a transformers-5 compatible class and once as the
upstream class is, whose ``__init__`` never calls ``post_init()`` (what breaks the released
``modeling_llada.py`` under transformers 5: ``all_tied_weights_keys``)."""

import os
import signal
import subprocess
import sys

import pytest
import transformers
from hf_fixtures import write_hf_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

CONFIGURATION = """
from transformers import PretrainedConfig


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""

MODELING = """
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_llada import LLaDAConfig


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, f, d = c.d_model, c.mlp_hidden_size, c.d_model // c.n_heads
        kv = c.n_kv_heads or c.n_heads
        self.attn_norm, self.ff_norm = RMSNorm(h, c.rms_norm_eps), RMSNorm(h, c.rms_norm_eps)
        self.q_proj, self.k_proj = nn.Linear(h, c.n_heads * d, bias=False), nn.Linear(h, kv * d, bias=False)
        self.v_proj, self.attn_out = nn.Linear(h, kv * d, bias=False), nn.Linear(c.n_heads * d, h, bias=False)
        self.ff_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.ff_out = nn.Linear(f, h, bias=False)
        self.heads, self.kv, self.d, self.theta = c.n_heads, kv, d, c.rope_theta

    def rope(self, x):  # x [B, heads, T, d]; LLaDA's rotate-half RoPE
        t = x.shape[2]
        inv = 1.0 / (self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float) / self.d))
        freqs = torch.outer(torch.arange(t, dtype=torch.float), inv)
        pos = torch.cat((freqs, freqs), dim=-1)
        x1, x2 = x.view(*x.shape[:-1], 2, self.d // 2).unbind(-2)
        return x * pos.cos() + torch.cat((-x2, x1), dim=-1) * pos.sin()

    def forward(self, x):
        b, t, _ = x.shape
        y = self.attn_norm(x)
        q = self.q_proj(y).view(b, t, self.heads, self.d).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.kv, self.d).transpose(1, 2)
        q, k = self.rope(q), self.rope(k)
        k = k.repeat_interleave(self.heads // self.kv, dim=1)
        v = v.repeat_interleave(self.heads // self.kv, dim=1)
        att = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask
        x = x + self.attn_out(att.transpose(1, 2).reshape(b, t, self.heads * self.d))
        y = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(y)) * self.up_proj(y))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        rows = c.embedding_size or c.vocab_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(rows, c.d_model),
                blocks=nn.ModuleList(Block(c) for _ in range(c.n_layers)),
                ln_f=RMSNorm(c.d_model, c.rms_norm_eps),
                ff_out=nn.Linear(c.d_model, rows, bias=False),
            )
        )

    def forward(self, ids):
        x = self.transformer.wte(ids)
        for block in self.transformer.blocks:
            x = block(x)
        return self.transformer.ff_out(self.transformer.ln_f(x))


class LLaDAModelLM(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = Inner(config)
        POST_INIT

    def _init_weights(self, module):
        pass

    def forward(self, input_ids=None, **kwargs):
        return CausalLMOutput(logits=self.model(input_ids))
"""


def _stand_in(folder, *, post_init):
    os.makedirs(folder)
    with open(os.path.join(folder, "configuration_llada.py"), "w") as handle:
        handle.write(CONFIGURATION)
    with open(os.path.join(folder, "modeling_llada.py"), "w") as handle:
        handle.write(MODELING.replace("POST_INIT", "self.post_init()" if post_init else "pass  # as upstream"))
    return os.path.join(folder, "modeling_llada.py")


def _convert(tmp_path, *argv, timeout=600):
    """``stabledrl convert *argv`` in a fresh process (transformers' remote-code cache under tmp_path)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        HF_HUB_OFFLINE="1",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "stabledrl_mcore.cli", "convert", *argv, "--no-progress"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def megatron_llada(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    src = write_hf_checkpoint(str(root / "hf"), "llada")
    ckpt = str(root / "mcore")
    code, out, err = _convert(root, "hf-to-mcore", "--model", "llada", "--hf-dir", src, "--out", ckpt)
    assert code == 0, err[-3000:]
    return ckpt


def test_the_export_loads_with_given_remote_code_and_matches_the_megatron_logits(megatron_llada, tmp_path):
    code_file = _stand_in(str(tmp_path / "code"), post_init=True)
    out = str(tmp_path / "hf_out")
    code, stdout, err = _convert(
        tmp_path, "mcore-to-hf", "--ckpt", megatron_llada, "--out", out, "--verify", "--remote-code", code_file
    )
    assert code == 0, err[-3000:]
    assert "verify: max abs logit difference" in stdout and "(ok tolerance" in stdout, stdout
    assert (
        not os.path.exists(os.path.join(out, "modeling_llada.py"))
        or open(os.path.join(out, "modeling_llada.py")).read() != open(code_file).read()
    ), "the given code is used from a scratch copy, not written into the export"


def test_upstream_style_code_that_does_not_load_is_one_line_naming_the_transformers_version(megatron_llada, tmp_path):
    code_file = _stand_in(str(tmp_path / "code"), post_init=False)
    out = str(tmp_path / "hf_out")
    code, stdout, err = _convert(
        tmp_path, "mcore-to-hf", "--ckpt", megatron_llada, "--out", out, "--verify", "--remote-code", code_file
    )
    if not TRANSFORMERS_5:  # transformers 4 sets no all_tied_weights_keys: the upstream-style class loads
        assert code == 0, err[-3000:]
        return
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("stabledrl convert: error: --reference remote could not load the upstream llada code")
    assert f"on transformers {transformers.__version__}" in lines[0]
    assert "all_tied_weights_keys" in lines[0] and "predates transformers 5" in lines[0]
    assert "transformers>=4.53,<5" in lines[0]
    assert not os.path.exists(out), "nothing is written when --verify fails"


def test_remote_code_needs_verify_and_an_existing_file(megatron_llada, tmp_path):
    code_file = _stand_in(str(tmp_path / "code"), post_init=True)
    out = str(tmp_path / "hf_out")
    code, _, err = _convert(tmp_path, "mcore-to-hf", "--ckpt", megatron_llada, "--out", out, "--remote-code", code_file)
    assert code == 2 and "--remote-code is used by --verify" in err and not os.path.exists(out)
    code, _, err = _convert(
        tmp_path, "mcore-to-hf", "--ckpt", megatron_llada, "--out", out, "--verify", "--remote-code", "/no/such.py"
    )
    assert code == 2 and "--remote-code /no/such.py: no such file" in err and not os.path.exists(out)
