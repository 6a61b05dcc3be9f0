"""`explain` names a site's inputs as the user wrote them: the argument of ``forward``
(``attention_mask``), the parameter's qualified name, not Dynamo's placeholder names."""

import pytest
import torch
import transformers

import attngraph
from attngraph.compiler.report import _name_from_source

from ..hf_models import build_model


@pytest.mark.parametrize("source, name", [
    ("L['kwargs']['attention_mask']", "attention_mask"),
    ("L['attention_mask']", "attention_mask"),
    ("L['args'][1]", "args[1]"),
    ("L['self']._modules['model']._modules['layers']._modules['0']._parameters['weight']", "model.layers.0.weight"),
    ("L['self'].rotary_emb.inv_freq", "rotary_emb.inv_freq"),
    ("L['x'].size()[0]", None),
    ("not a source", None),
])  # fmt: skip
def test_name_from_source(source, name):
    assert _name_from_source(source) == name


def test_padding_mask_is_named_attention_mask():
    model = build_model("llama", "sdpa")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    report = attngraph.explain(model, ids, attention_mask=mask)
    assert len(report.sites) == 2 and not any(s.lowered for s in report.sites)
    for s in report.sites:
        assert "input(s) attention_mask " in s.reason and "l_kwargs" not in s.reason, s.reason


def test_t5_position_bias_is_named_by_its_parameter():
    cfg = transformers.T5Config(d_model=64, d_ff=96, num_layers=2, num_heads=4, d_kv=16, vocab_size=96)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    text = str(attngraph.explain(model, input_ids=ids, decoder_input_ids=ids))
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in text, text
    assert "l_self_modules" not in text and "_modules_" not in text, text
