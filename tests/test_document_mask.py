"""Block-causal attention over packed documents (`model.attn_mask_type = "block_causal"`,
`titan_models.document_mask`), single process on CPU, float32.

The reference is the model itself run on each document alone: RoPE makes attention depend only on the
distance between positions, so a document's logits inside a packed sequence under the block-causal mask
must equal its logits when it is the whole sequence, in every family; its gradients likewise. The
document ids and masks are checked against tables written out by hand. The multi-process layouts
against one process, on short documents, are rows of the parity matrix (`block_causal_*`: FSDP 2 x TP 2,
two pipeline schedules, whose later stages build the mask from their micro-batch's document ids, and FSDP 2 x
CP 2 with Ulysses and with ring attention, whose attention takes the whole sequence's mask). A model whose
forward takes no document ids is refused by the job check (test_job_check).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity_matrix import short_documents
from titan_run import TINY, losses, run_titan_shared

from titan_core.kernel_lines import describe_attention
from titan_models import get_model_args, get_model_spec
from titan_models.document_mask import block_causal_mask, document_ids, masked_attention

BOS, EOS = 1, 2
TOL = 1e-5  # fp32 logits of O(1)-O(10): only the order of sums differs


def test_a_document_opens_where_bos_follows_eos():
    # A sequence cut mid-document, two boundaries, and a bos inside a document's text (no eos before it).
    tokens = torch.tensor([[5, 6, EOS, BOS, 7, EOS, BOS, 8, BOS, 9]])
    assert document_ids(tokens, BOS, EOS).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 2]]
    # One token for both (Qwen's <|endoftext|>): the eos closes, the next one opens, once per boundary.
    same = 3
    tokens = torch.tensor([[5, same, same, 7, 8, same, same, 9], [same, 4, 4, same, same, 4, 4, 4]])
    assert document_ids(tokens, same, same).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1]]


def test_the_dense_mask_by_hand():
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 2]]), flex=False)
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]]
    # Off CUDA the dense mask is the default; on CUDA FlexAttention's (the start-up line says which).
    assert torch.equal(block_causal_mask(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 2]])), mask)
    assert describe_attention("cuDNN first", "block_causal", torch.device("cuda")).startswith("FlexAttention, compiled")
    assert describe_attention("cuDNN first", "causal", torch.device("cuda")) == "cuDNN first"
    # Under ring CP the ring's own kernel, the mask read at each block's positions.
    ring = describe_attention("cuDNN first", "block_causal", torch.device("cuda"), ring="rotate")
    assert ring == "ring attention, K/V rotated rank to rank: fp32 matmuls per step, merged by log-sum-exp within each " \
        "document (model.attn_mask_type)"
    cpu = describe_attention("order", "causal", torch.device("cpu"), ring="rotate")
    assert cpu == "ring attention, K/V rotated rank to rank: torch's fused CPU attention kernel per step, merged by log-sum-exp"
    assert describe_attention("order", "causal", torch.device("cpu"), ring="allgather") == (
        "ring attention, K/V all-gathered: SDPA with an explicit mask, order"
    )


def build(name: str, flavor: str) -> torch.nn.Module:
    spec, args = get_model_spec(name), get_model_args(name, flavor)
    torch.manual_seed(0)
    model = spec.build(args)
    model.init_weights()
    return model


def documents(seed: int, lengths: tuple[int, ...], vocab: int) -> list[torch.Tensor]:
    """`[bos] ids [eos]` per document, the first cut at its start and the last at its end, as packing leaves them."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.tensor([BOS]), torch.randint(3, vocab, (n,), generator=generator), torch.tensor([EOS])])
            for n in lengths]  # fmt: skip
    docs[0], docs[-1] = docs[0][3:], docs[-1][:-2]
    return docs


FAMILIES = [
    ("llama3", "debugmodel"),
    ("qwen3", "debugmodel"),
    ("qwen3_moe", "debugmodel_moe"),
    ("deepseek_v3", "debugmodel"),
]


# On a GPU the same checks run FlexAttention (compiled, a BlockMask); on CPU the dense mask.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "flavor"), FAMILIES)
def test_a_packed_document_reads_as_the_document_alone(name, flavor, device):
    model = build(name, flavor).eval().to(device)
    docs = [[d.to(device) for d in documents(1, (9, 13, 4, 11), 2048)],
            [d.to(device) for d in documents(2, (20, 5, 17), 2048)]]  # fmt: skip
    width = min(sum(len(d) for d in row) for row in docs)
    packed = torch.stack([torch.cat(row)[:width] for row in docs])  # (2, width)
    with torch.no_grad():
        out = model(packed, document_ids=document_ids(packed, BOS, EOS))  # (2, width, vocab)
        plain = model(packed)
        for b, row in enumerate(docs):
            start = 0
            for doc in row:
                doc = doc[: width - start]
                if len(doc) == 0:
                    break
                alone = model(doc[None])[0]  # (len, vocab)
                assert (out[b, start : start + len(doc)] - alone).abs().max() < TOL, (b, start)
                start += len(doc)
    # Without the mask a later document attends to the earlier ones: its logits move by O(1).
    assert (plain - out).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_of_a_packed_batch_are_those_of_its_documents(device):
    model = build("llama3", "debugmodel").to(device)
    docs = [d.to(device) for d in documents(3, (12, 7, 15, 6), 2048)]
    packed = torch.cat(docs)[None]  # (1, n)
    inputs, labels = packed[:, :-1], packed[:, 1:]
    loss = F.cross_entropy(model(inputs, document_ids=document_ids(inputs, BOS, EOS))[0], labels[0], reduction="sum")
    loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    # Each document alone, predicting its own next tokens and, at its eos, the next document's bos
    # (the packed sequence's label there).
    total = torch.zeros((), device=device)
    for i, doc in enumerate(docs):
        following = docs[i + 1][:1] if i + 1 < len(docs) else doc[:0]
        target = torch.cat([doc[1:], following])
        logits = model(doc[None])[0, : len(target)]
        total = total + F.cross_entropy(logits, target, reduction="sum")
    total.backward()
    assert torch.allclose(loss, total, rtol=1e-6)
    for name, p in model.named_parameters():  # relative to the largest entry: sums of O(10) terms in fp32
        scale = p.grad.abs().max()
        assert (packed_grads[name] - p.grad).abs().max() <= 1e-5 * scale, (name, scale)


@pytest.mark.parametrize(("heads", "kv_heads", "qk_dim", "v_dim", "scale"), [(4, 2, 32, 32, None), (4, 4, 48, 32, 0.1)])
def test_flex_attention_reads_the_mask_as_the_dense_one(heads, kv_heads, qk_dim, v_dim, scale):
    """The kernel CUDA runs (FlexAttention, a `BlockMask` over 128-token tiles), forward only: torch has no CPU
    backward for it. Grouped-query heads, and MLA's key and value head dims, which differ."""
    generator = torch.Generator().manual_seed(0)
    seqlen = 384  # three tiles: some wholly masked, some partly
    q = torch.randn(2, heads, seqlen, qk_dim, generator=generator)
    k = torch.randn(2, kv_heads, seqlen, qk_dim, generator=generator)
    v = torch.randn(2, kv_heads, seqlen, v_dim, generator=generator)
    ids = torch.cumsum(torch.rand(2, seqlen, generator=generator) < 0.01, dim=1)  # documents of ~100 tokens
    ids[1] = torch.arange(seqlen) // 200  # one boundary, inside the second tile
    dense = masked_attention(q, k, v, block_causal_mask(ids, flex=False), scale=scale)
    flex = masked_attention(q, k, v, block_causal_mask(ids, flex=True), scale=scale)
    assert flex.shape == (2, heads, seqlen, v_dim)
    assert (flex - dense).abs().max() < TOL


def test_compiled_blocks_take_the_mask_as_eager_ones_do():
    """Regional compile (each block, inductor's C++ backend on CPU) with the dense mask as a block input."""
    model = build("llama3", "debugmodel")
    docs = documents(4, (30, 12, 40), 2048)
    tokens = torch.cat(docs)[None, :64]  # (1, 64)
    ids = document_ids(tokens, BOS, EOS)
    eager = model(tokens, document_ids=ids)
    eager.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block))
    compiled = model(tokens, document_ids=ids)
    compiled.float().pow(2).mean().backward()
    assert (compiled - eager).abs().max() < TOL
    for name, p in model.named_parameters():
        reference = grads[name.replace("._orig_mod", "")]
        assert (p.grad - reference).abs().max() <= 1e-5 * reference.abs().max(), name


def test_titan_train_masks_what_it_trains_on(tmp_path):
    """The trainer hands the model each batch's documents: at step 1 (the same weights, the same batch) the loss
    under the mask differs from the causal one on short documents, and the start-up line names the kernel."""
    data = ["--training.dataset_path", short_documents(), "--training.steps", "2"]
    masked, causal = tmp_path / "masked", tmp_path / "causal"
    runs = {masked: [*TINY, *data, "--model.attn_mask_type", "block_causal"], causal: [*TINY, *data]}
    assert run_titan_shared(runs) == {masked, causal}, (tmp_path / "jobs-masked.log").read_text()[-3000:]
    masked_loss, causal_loss = losses(masked)[0], losses(causal)[0]
    assert abs(masked_loss - causal_loss) > 1e-3, (masked_loss, causal_loss)
    log = (tmp_path / "jobs-masked.log").read_text()
    assert "attention kernel: SDPA with a dense mask within each document (model.attn_mask_type)" in log
