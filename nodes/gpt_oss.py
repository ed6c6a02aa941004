"""The size of a gpt-oss text encoder file (ComfyUI 0.33's Lens encoder), read from its tensors.

ComfyUI 0.33 builds every gpt-oss encoder at gpt-oss-20b's size (comfy/text_encoders/gpt_oss.py,
`GptOss20BConfig`) unless model_options carries "gpt_oss_config". Load FP8 Text Encoder passes the fields
whose sizes the file's tensors set otherwise, so a smaller encoder loads too, while a gpt-oss-20b file gets
no override and loads exactly as in stock ComfyUI. Trees without gpt-oss are left alone.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def _gpt_oss_module():
    """comfy.text_encoders.gpt_oss, or None on trees older than 0.33."""
    try:
        import comfy.text_encoders.gpt_oss as gpt_oss
    except ImportError:
        return None
    return gpt_oss


def _dims(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def read_config(sd: dict, where: str) -> dict:
    """{field: value} of `GptOss20BConfig` for the fields the tensors of `sd` (a gpt-oss encoder, keys as
    ComfyUI 0.33 detects them: `layers.N.…`, `embed_tokens.weight`) set to other values than its defaults;
    {} for gpt-oss-20b's sizes. Shapes are logical: a quantized bank's `[E, out, in]`, not its packed bytes.
    Raises ValueError naming `where` and the tensor when the shapes disagree among themselves."""
    defaults = _gpt_oss_module().GptOss20BConfig()

    def shape(key: str) -> tuple[int, ...]:
        t = sd.get(key)
        if t is None:
            raise ValueError(f"{where}: this gpt-oss text encoder has no tensor {key}")
        return tuple(t.shape)

    def refuse(key: str, why: str):
        raise ValueError(f"{where}: {key} {_dims(shape(key))} {why}; the file is not one consistent gpt-oss encoder")

    vocab, hidden = shape("embed_tokens.weight")
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers.") and k.split(".")[1].isdigit())
    heads = shape("layers.0.self_attn.sinks")[0]
    q_rows = shape("layers.0.self_attn.q_proj.weight")[0]
    if heads == 0 or q_rows % heads:
        refuse("layers.0.self_attn.q_proj.weight", f"has rows that do not divide among the {heads} heads of "
               "layers.0.self_attn.sinks")
    head_dim = q_rows // heads
    k_rows = shape("layers.0.self_attn.k_proj.weight")[0]
    if k_rows % head_dim or k_rows == 0 or heads % (k_rows // head_dim):
        refuse("layers.0.self_attn.k_proj.weight", f"has rows that are not head_dim {head_dim} (q_proj rows / heads) "
               f"times a divisor of the {heads} heads")
    kv_heads = k_rows // head_dim
    experts = shape("layers.0.mlp.router.weight")[0]
    gate_up_rows = shape("layers.0.mlp.experts.gate_up_proj.weight")[1]
    if gate_up_rows % 2:
        refuse("layers.0.mlp.experts.gate_up_proj.weight", "has an odd number of rows (gate and up interleaved)")
    inter = gate_up_rows // 2

    expected = {  # every layer's tensors, as GptOssDecoderLayer builds them
        "self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden), "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.sinks": (heads,), "mlp.router.weight": (experts, hidden),
        "mlp.experts.gate_up_proj.weight": (experts, 2 * inter, hidden),
        "mlp.experts.down_proj.weight": (experts, hidden, inter),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
    }
    checks = [("norm.weight", (hidden,))]
    checks += [(f"layers.{i}.{name}", dims) for i in range(layers) for name, dims in expected.items()]
    for key, dims in checks:
        if shape(key) != dims:
            refuse(key, f"is not {_dims(dims)} (from embed_tokens.weight {_dims((vocab, hidden))}, {heads} heads of "
                   f"{head_dim}, {kv_heads} key/value heads, {experts} experts of {inter})")

    found = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, num_local_experts=experts)
    if experts < defaults.num_experts_per_tok:  # the router's top-k cannot pick more experts than there are
        found["num_experts_per_tok"] = experts
    return {name: value for name, value in found.items() if value != getattr(defaults, name)}


def lens_options(sd: dict, where: str) -> dict:
    """model_options for a text encoder state dict on this tree: {"gpt_oss_config", maybe "selected_layers"}
    when ComfyUI's own detection takes it for gpt-oss (0.33 then builds the Lens encoder, whatever type was
    chosen) and its size is not gpt-oss-20b's, else {} (stock behaviour). The Lens selected layers are kept
    unless the file has too few layers for them."""
    import comfy.sd

    gpt_oss = _gpt_oss_module()
    gpt_oss_model = getattr(comfy.sd.TEModel, "GPT_OSS_20B", None)
    if gpt_oss is None or gpt_oss_model is None or comfy.sd.detect_te_model(sd) != gpt_oss_model:
        return {}
    config = read_config(sd, where)
    if not config:
        return {}
    options = {"gpt_oss_config": config}
    layers = config.get("num_hidden_layers", gpt_oss.GptOss20BConfig.num_hidden_layers)
    selected = tuple(gpt_oss.LENS_SELECTED_LAYERS)
    if max(selected) >= layers:
        n = min(len(selected), layers)  # the rule that gives Lens's (5, 11, 17, 23) from 24 layers
        options["selected_layers"] = tuple((i + 1) * layers // n - 1 for i in range(n))
        logger.info("%s: %d layers, too few for the Lens encoder's selected layers %s; taking layers %s "
                    "(evenly spaced, ending at the last)", where, layers, selected, options["selected_layers"])
    logger.info("%s: a gpt-oss text encoder of its own size: %s", where, config)
    return options
