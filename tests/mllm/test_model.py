"""The MLLM on megatron-core, single CPU process (gloo world of 1 through the CPU harness)."""
import itertools
import math
import re
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

from megatron_orch.trainer import cpu_harness  # noqa: E402

cpu_harness.install()

from megatron.core import tensor_parallel  # noqa: E402

from megatron_orch.megatron.batch import collate, collate_packed  # noqa: E402
from megatron_orch.megatron.contract import BalanceableModel, forward_step, loss_func  # noqa: E402
from megatron_orch.mllm.config import load_model_config  # noqa: E402
from megatron_orch.mllm.examples import assemble_example  # noqa: E402
from megatron_orch.mllm import model as model_module  # noqa: E402
from megatron_orch.mllm.model import MLLMModel, ModelParallelSettings  # noqa: E402
from megatron_orch.trainer import arguments, loop as trainer  # noqa: E402
from megatron_orch.mllm.task import MLLM_TASK

SEQ_LENGTH = 128
TINY = load_model_config("tiny")
IMAGE_TOKEN_ID, AUDIO_TOKEN_ID = (TINY.encoders[name].placeholder_id for name in ("vision", "audio"))


@pytest.fixture()
def model(world_of_one):
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return MLLMModel(TINY, ModelParallelSettings(), SEQ_LENGTH)


def make_example(model, index, vision_items, audio_items, answer_tokens, seed=0):
    spec = model.spec
    g = torch.Generator().manual_seed(seed * 1000 + index)
    items = {phase: torch.randn(n, *spec.input(phase).item_shape, generator=g)
             for phase, n in (("vision", vision_items), ("audio", audio_items))}
    answer = torch.randint(97, 123, (answer_tokens,), generator=g).tolist()
    return assemble_example(index, [116, 58, 32], answer, items, spec)


def run(model, batch):
    return model(batch)


def test_the_model_meets_the_contract(model):
    assert isinstance(model, BalanceableModel)
    assert list(model.phase_encoders()) == ["vision", "audio"]
    later_stage = MLLMModel(TINY, ModelParallelSettings(), SEQ_LENGTH, pre_process=False)
    assert later_stage.phase_encoders() == {}


def test_forward_backward_gives_per_token_loss_and_grads_everywhere(model):
    batch = collate([make_example(model, 0, 2, 1, 10), make_example(model, 1, 0, 3, 5),
                     make_example(model, 2, 1, 0, 20)], model.spec)
    losses = run(model, batch)
    assert losses.shape == batch.tokens.shape
    loss, num_tokens, _ = loss_func(batch.loss_mask, losses)
    assert int(num_tokens) == int(batch.loss_mask.sum()) == 11 + 6 + 21
    # Untrained: about the entropy of a uniform guess over the (padded) vocabulary.
    assert abs(loss.item() / int(num_tokens) - math.log(1024)) < 0.5
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_embeddings_are_spliced_at_their_placeholders_in_item_order(model):
    batch = collate([make_example(model, 0, 2, 1, 4), make_example(model, 1, 1, 2, 6)], model.spec)
    h = model.config.hidden_size
    vision_embeds = torch.randn(3 * model.spec.rows_per_item("vision"), h)
    audio_embeds = torch.randn(3 * model.spec.rows_per_item("audio"), h)
    with torch.no_grad():
        spliced = model.embed(batch, {"vision": vision_embeds, "audio": audio_embeds})  # [s, b, h]
        plain = model.backbone.embedding(input_ids=batch.tokens, position_ids=batch.position_ids)
    for token_id, embeds in ((IMAGE_TOKEN_ID, vision_embeds), (AUDIO_TOKEN_ID, audio_embeds)):
        expected = iter(embeds)
        for row in range(batch.tokens.shape[0]):
            for col in range(batch.tokens.shape[1]):
                if batch.tokens[row, col] == token_id:
                    assert torch.equal(spliced[col, row], next(expected))
        assert next(expected, None) is None
    text = (batch.tokens != IMAGE_TOKEN_ID) & (batch.tokens != AUDIO_TOKEN_ID)
    assert torch.equal(spliced.transpose(0, 1)[text], plain.transpose(0, 1)[text])


def test_placeholder_count_mismatch_is_an_error(model):
    batch = collate([make_example(model, 0, 2, 0, 4)], model.spec)
    too_few = torch.zeros(model.spec.rows_per_item("vision"), model.config.hidden_size)
    with pytest.raises(ValueError, match="8 vision placeholder tokens .* but 4 vision embeddings"):
        model(batch, embeds={"vision": too_few})


def test_encoders_encode_each_item_independently(model):
    """Items can be encoded on any rank in any grouping: no padding, no cross-item attention."""
    spec = model.spec
    with torch.no_grad():
        for phase, n in (("vision", 5), ("audio", 4)):
            items, per_item = torch.randn(n, *spec.input(phase).item_shape), spec.rows_per_item(phase)

            def encode(part, phase=phase):
                return model.encode(phase, part)
            together = encode(items)
            assert together.shape == (items.shape[0] * per_item, model.config.hidden_size)
            apart = torch.cat([encode(items[:2]), encode(items[2:3]), encode(items[3:])])
            torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
            assert encode(items[:0]).shape == (0, model.config.hidden_size)


def test_micro_batch_without_any_media_trains_the_backbone_only(model):
    batch = collate([make_example(model, 0, 0, 0, 12), make_example(model, 1, 0, 0, 3)], model.spec)
    loss, _, _ = loss_func(batch.loss_mask, run(model, batch))
    loss.backward()
    assert model.encoders["vision"].patch_embedding.weight.grad is None
    assert model.encoders["audio"].conv1.weight.grad is None
    assert model.backbone.embedding.word_embeddings.weight.grad is not None


def test_packed_rows_match_padded_rows(model):
    """A packed row (variable-length attention, each example causal on its own) gives each example's own loss."""
    examples = [make_example(model, 0, 1, 1, 7), make_example(model, 1, 2, 0, 3)]
    padded, packed = collate(examples, model.spec), collate_packed(examples, model.spec)
    with torch.no_grad():
        per_token_padded = run(model, padded)
        per_token_packed = run(model, packed)
    sum_padded = (per_token_padded * padded.loss_mask).sum()
    sum_packed = (per_token_packed * packed.loss_mask).sum()
    torch.testing.assert_close(sum_packed, sum_padded, rtol=1e-5, atol=1e-5)


def test_loss_decreases_when_overfitting_one_batch(world_of_one):
    argv = ["--seq-length", str(SEQ_LENGTH), "--micro-batch-size", "4", "--train-iters", "12", "--lr", "3e-3",
            "--lr-decay-style", "constant", "--clip-grad", "1.0", "--log-interval", "1", "--distributed-backend", "gloo"]
    args = arguments.parse_args(MLLM_TASK, argv, world_size=1)
    trainer.set_random_seed(args.seed)
    timers = trainer.Timers(log_level=1, log_option="minmax")
    model = trainer.build_model(args, MLLM_TASK.build_model)
    optimizer, scheduler = trainer.build_optimizer(args, model, timers)
    trainer.attach_to_model_config(model, optimizer, timers)
    unwrapped = model[0].module
    batch = collate([make_example(unwrapped, i, i % 3, (i + 1) % 3, 12, seed=7) for i in range(4)], unwrapped.spec)
    losses = [trainer.train_step(forward_step, itertools.repeat(batch), model, optimizer, scheduler,
                                 args, timers)["lm_loss"] for _ in range(args.train_iters)]
    assert losses[0] > 6.0
    assert losses[-1] < losses[0] - 3.0, losses
    assert all(later < earlier for earlier, later in zip(losses[::3], losses[3::3])), losses


def test_built_model_has_the_parameters_its_config_counts(model):
    """The config's count (what the benchmarks and the README quote) is the model that is built, but for
    the biases and norm weights the count leaves out (under 1% here)."""
    built = sum(p.numel() for p in model.parameters())
    counted = TINY.num_parameters()["total"]
    assert counted <= built <= 1.01 * counted, (counted, built)


def gpt_name(hybrid_name: str) -> str:
    """The GPTModel backbone's name of a HybridModel backbone's parameter (megatron_orch.mllm.hybrid): stack
    layers 2i (attention) and 2i + 1 (MLP) are transformer layer i; final_norm is final_layernorm."""
    layer = re.match(r"backbone\.decoder\.layers\.(\d+)\.(.*)", hybrid_name)
    if layer:
        return f"backbone.decoder.layers.{int(layer.group(1)) // 2}.{layer.group(2)}"
    return hybrid_name.replace("backbone.decoder.final_norm.", "backbone.decoder.final_layernorm.")


@pytest.mark.skipif(not model_module.HYBRID_BACKBONE, reason="this megatron-core has no HybridModel (before 0.19): "
                    "the backbone is GPTModel, nothing to compare")
def test_the_hybrid_backbone_is_the_gpt_backbone(world_of_one, monkeypatch):
    """HybridModel's stack of attention and MLP layers draws the GPTModel backbone's initial weights (every
    parameter, bit for bit, under GPTModel's names) and gives its loss and gradients, bit for bit, on a batch
    with images and audio, so the figures measured with GPTModel hold."""
    def build(hybrid):
        monkeypatch.setattr(model_module, "HYBRID_BACKBONE", hybrid)
        torch.manual_seed(3)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        return MLLMModel(TINY, ModelParallelSettings(), SEQ_LENGTH)

    hybrid, gpt = build(True), build(False)
    assert type(hybrid.backbone).__name__ == "HybridModel" and type(gpt.backbone).__name__ == "GPTModel"
    assert hybrid.backbone.hybrid_layer_pattern == "*-*-"
    hybrid_params = {gpt_name(name): p for name, p in hybrid.named_parameters()}
    gpt_params = dict(gpt.named_parameters())
    assert hybrid_params.keys() == gpt_params.keys()
    for name, param in gpt_params.items():
        assert torch.equal(hybrid_params[name], param), name
    batch = collate([make_example(gpt, 0, 2, 1, 10), make_example(gpt, 1, 0, 2, 5)], gpt.spec)
    losses = {}
    for name, model in (("hybrid", hybrid), ("gpt", gpt)):
        loss, _, _ = loss_func(batch.loss_mask, run(model, batch))
        loss.backward()
        losses[name] = loss.detach()
    assert torch.equal(losses["hybrid"], losses["gpt"]), losses  # the same operations in the same order
    for name, param in gpt_params.items():
        assert torch.equal(hybrid_params[name].grad, param.grad), name
