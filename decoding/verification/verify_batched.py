"""The acceptance rule of ``acceptance.py`` for a whole batch at once, as tensor operations on the logits' device.

``acceptance.py`` stays the readable reference (one row, Python control flow); this module is what the engine
runs. Tests compare the two exactly (``tests/test_verify_batched.py``). Nothing here synchronizes with the host:
no ``.item()``, no data-dependent Python branch, no ``nonzero``. Randomness comes in as ``uniforms`` that the
caller draws from each row's own generator, so a seeded row is reproducible whatever else shares its batch.

How the walk is batched. Nodes are laid out level by level (``tree.py``). Node 0, the pending token, is always
accepted: it was drawn from the root law that is also its proposal, so its ratio p/q is exactly 1 (greedy: it is
the root argmax by construction). From there every row walks down one level per iteration. At a level, a row's
candidate children are visited in sibling order (rank 0, 1, ...), each rank one vectorized step over the batch:
accept child x with probability min(1, p(x)/q(x)); after a rejection p becomes the residual norm(max(0, p - q))
and, without replacement, x leaves q. A row that accepts nothing at a level stops there; its next token comes
from p as it then is (the residual, or the target law at an accepted leaf), exactly as in ``verify_sampled``.
Greedy rows ride along with p/q replaced by "x equals the target's argmax", which is ``verify_greedy``; a batch
of greedy rows only takes the same walk in closed form (``greedy_path``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from decoding.model.execution import Execution
from decoding.verification.sampling import NO_TOKEN, WarpParams, argmax_logsumexp, or_no_token, warp_probs
from decoding.verification.tree import TreeTopology


@dataclass(frozen=True)
class BatchVerdict:
    path: torch.Tensor  # [B, D + 1] accepted nodes top-down (node 0 first), -1 past each row's end
    path_length: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B] the token the target adds after the path
    next_law: torch.Tensor  # [B, V] law next_token came from; greedy rows: the target's logits at the last node
    token_probs: torch.Tensor  # [B, N] target probability of each node's token at its parent (greedy rows: T = 1)


@cache
def children_table(topology: TreeTopology) -> torch.Tensor:
    """[N, w] long: the r-th child of each node of the largest tree (-1: none), in sibling order."""
    kids: list[list[int]] = [[] for _ in topology.parents]
    for node, parent in enumerate(topology.parents):
        if parent >= 0:
            kids[parent].append(node)
    width = max([len(k) for k in kids] + [1])
    return torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.long)


@cache
def earlier_siblings(topology: TreeTopology) -> torch.Tensor:
    """[N, N] bool over the largest tree: entry (n, m) marks m as a sibling of n before it in sibling order."""
    parents = topology.parents
    return torch.tensor([[m < n and parents[m] == parent >= 0 for m in range(len(parents))]
                         for n, parent in enumerate(parents)], dtype=torch.bool)


@cache
def _greedy_tables(topology: TreeTopology, size: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``greedy_path``'s constants for a tree of ``size`` nodes, on ``device`` (built once, not copied every step):
    which nodes are children [N], earlier siblings [N, N], ancestors [N, N], each node's depth one-hot [N, D + 1]."""
    depths = topology.depths[:size]
    is_child = torch.tensor([p >= 0 for p in topology.parents[:size]])
    at_depth = depths[:, None] == torch.arange(int(depths[-1]) + 1)[None]
    return (is_child.to(device), earlier_siblings(topology)[:size, :size].to(device),
            topology.ancestors[:size, :size].to(device), at_depth.to(device))


def greedy_path(argmax: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, topology: TreeTopology,
                parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The level-by-level walk for rows that all decode greedily, without the walk: (path [B, D + 1], its length).

    A node is taken when its token is its parent's argmax and no sibling before it is (the walk takes the first
    such child): node 0 and the nodes whose ancestors are all taken form the path, one node per depth. A handful
    of operations whatever the depth, where the walk runs a dozen per level and sibling (0.3 ms of a depth-5 step
    of a small model on a CPU). ``parents`` [N]: each node's parent on the tokens' device (roots: 0)."""
    size = tokens.shape[1]
    if size == 1:  # a plain step: the path is node 0
        return torch.zeros_like(tokens), torch.ones_like(tokens[:, 0])
    is_child, earlier, ancestors, at_depth = _greedy_tables(topology, size, tokens.device)
    match = (tokens == argmax.gather(1, parents[None].expand_as(tokens))) & valid & is_child
    match[:, 0] = True
    taken = match & ~(match[:, None, :] & earlier[None]).any(-1)
    on_path = ~((~taken)[:, None, :] & ancestors[None]).any(-1)  # [B, N]
    placed = on_path[:, :, None] & at_depth[None]  # [B, N, D + 1]
    has = placed.any(1)
    path = torch.where(has, placed.to(torch.int8).argmax(1), -1)
    return path, has.sum(-1)


# Entries per block of the two-level CDF inversion in ``sample_from``.
_CDF_BLOCK = 256


def sample_from(law: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``law`` [B, V] (weights, not necessarily normalized) by inverting its CDF at
    ``uniform`` [B] in [0, 1). A token of weight 0 is never chosen: the first index whose cumulative weight
    exceeds u·total. In float64 (the sum over a 49k vocabulary in float32 would bias the tail), in two levels: the
    block holding the threshold from the blocks' sums, then the index within that block. One cumulative sum over
    the whole vocabulary in float64 cost 6 ms a step for 64 rows of SmolLM2's vocabulary on a 2-core CPU."""
    rows, vocab = law.shape
    blocks = -(-vocab // _CDF_BLOCK)
    weights = law.double()
    if blocks * _CDF_BLOCK != vocab:
        weights = torch.nn.functional.pad(weights, (0, blocks * _CDF_BLOCK - vocab))
    weights = weights.view(rows, blocks, _CDF_BLOCK)
    block_cdf = weights.sum(-1).cumsum(-1)  # [B, blocks]
    threshold = uniform.double() * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, threshold[:, None], right=True).clamp(max=blocks - 1)  # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    within = weights.gather(1, block[:, :, None].expand(-1, -1, _CDF_BLOCK))[:, 0].cumsum(-1)  # [B, 256]
    index = torch.searchsorted(within, (threshold[:, None] - before), right=True).clamp(max=_CDF_BLOCK - 1)
    return (block[:, 0] * _CDF_BLOCK + index[:, 0]).clamp(max=vocab - 1)


def sample_tokens(law: torch.Tensor, uniforms: torch.Tensor, replacement: bool) -> torch.Tensor:
    """``k`` tokens per row of ``law`` [B, V] (weights) from ``uniforms`` [B, k]: independent draws, or (without
    replacement) successive draws each from what the previous ones left, which is ``torch.multinomial``'s law
    without replacement. Past a row's support its first draw repeats: verification skips a repeat of a rejected
    token (its proposal mass is 0), so the padding only wastes width."""
    count = uniforms.shape[1]
    if replacement:
        flat = law[:, None].expand(-1, count, -1).reshape(-1, law.shape[-1])
        return sample_from(flat, uniforms.reshape(-1)).view(-1, count)
    rows = torch.arange(law.shape[0], device=law.device)
    rest = law.float().clone()
    picks: list[torch.Tensor] = []
    for k in range(count):
        left = rest.sum(-1) > 0
        token = sample_from(rest, uniforms[:, k])
        token = torch.where(left, token, picks[0] if picks else token)
        rest[rows, token] = 0
        picks.append(token)
    return torch.stack(picks, 1)


def sample_siblings(
    root_scores: torch.Tensor,
    pending: torch.Tensor,
    greedy: torch.Tensor,
    count: int,
    replacement: bool,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """``count`` target-initialized siblings of the pending token per row [B, count]; -1 where a row has none.

    Greedy rows: the best-scored tokens other than the pending one. Sampled rows: draws from the root law (with
    replacement), or distinct draws from it with the pending token removed (without); see ``sample_tokens``.
    """
    batch = root_scores.shape[0]
    ranked = root_scores.topk(min(count + 1, root_scores.shape[-1]), dim=-1).indices
    others = ranked != pending[:, None]
    order = torch.argsort((~others).to(torch.int8), dim=1, stable=True)  # keeps the rank order of the others
    best = ranked.gather(1, order)[:, :count]
    rows = torch.arange(batch, device=root_scores.device)
    if replacement:
        law = root_scores
        has = torch.ones(batch, dtype=torch.bool, device=root_scores.device)
    else:
        law = root_scores.float().clone()
        law[rows, pending] = 0
        has = law.sum(-1) > 0
    drawn = sample_tokens(law, uniforms[:, :count], replacement)
    sampled = torch.where(has[:, None], drawn, torch.full_like(drawn, -1))
    return torch.where(greedy[:, None], best, sampled)


def verify_batch(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    topology: TreeTopology,
    warp: WarpParams,
    root_scores: torch.Tensor,
    draft_probs: torch.Tensor | None,
    replacement: bool,
    uniforms: torch.Tensor | None,
    point_mass: torch.Tensor | None = None,
    may_empty: bool = False,
    execution: Execution | None = None,
) -> BatchVerdict:
    """Verify every row's tree; all tensors on the logits' device.

    logits [B, N, V]: the target's raw logits at each node. tokens, valid [B, N]. warp: per-row warping
    (temperature 0 = greedy). root_scores [B, V]: the law the pending token came from (greedy rows: logits).
    draft_probs [B, N, V]: the drafter's warped law at each node (proposal of its children); None = deterministic
    proposals (n-gram), q = one-hot. uniforms [B, N + 1] in [0, 1): node n's acceptance draw at column n, the
    next token's at the last column; None when every row is greedy (nothing random then). point_mass [B, N]: nodes
    proposed deterministically beside a model's candidates (n-gram siblings): their q is one-hot whatever
    ``draft_probs`` says at their parent. ``may_empty``: a node's law may have nothing left (the logits are processed:
    bans, grammar masks); no token is accepted below such a node, and a row ending at one gets ``NO_TOKEN`` next
    (whatever the draft proposed there, on a law of its own that may have been made uniform). ``execution``: the
    engine's, which says whether the CPU kernels run (None: torch's operations).
    """
    batch, size, vocab = logits.shape
    device = logits.device
    rows = torch.arange(batch, device=device)
    parents = torch.tensor([max(p, 0) for p in topology.parents[:size]]).to(device, non_blocking=True)
    levels = int(topology.depths[size - 1])
    kids = children_table(topology).to(device, non_blocking=True)
    greedy = warp.greedy
    sampling = uniforms is not None

    argmax, logsumexp = argmax_logsumexp(logits, not sampling and size > 1, execution)  # [B, N] each
    if may_empty:  # NO_TOKEN at the nodes whose law is empty: no drafted token equals it, none below is accepted
        argmax = or_no_token(argmax, logits)
    if sampling:
        # Greedy rows get the plain softmax (their statistics are at temperature 1, unwarped).
        probs = warp_probs(logits, warp.sampling_only(greedy))  # [B, N, V] float32
        if may_empty:  # an empty law (which warp_probs made uniform) accepts nothing: no mass
            probs = probs.masked_fill((argmax == NO_TOKEN)[..., None], 0.0)
        token_probs = probs[rows[:, None], parents[None], tokens]
    elif size == 1:  # a plain step: no drafted node, no statistic (a vocabulary-wide logsumexp per row saved)
        token_probs = logits.new_zeros(batch, 1, dtype=torch.float32)
    else:
        token_probs = (logits[rows[:, None], parents[None], tokens].float() - logsumexp[:, parents]).exp()
    if not sampling:
        path, length = greedy_path(argmax, tokens, valid, topology, parents)
        cur = path.gather(1, (length - 1)[:, None])[:, 0]
        return BatchVerdict(path, length, argmax[rows, cur], logits[rows, cur].float(), token_probs)

    cur = torch.zeros(batch, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    path = torch.full((batch, levels + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    law = probs[:, 0]  # [B, V]: p at each row's current node, then its residual
    for level in range(1, levels + 1):
        best = argmax[rows, cur]
        law = torch.where(alive[:, None], probs[rows, cur], law)
        q_base = draft_probs[rows, cur].float() if draft_probs is not None else None
        removed = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        chosen = torch.full_like(cur, -1)
        for rank in range(kids.shape[1]):
            kid = kids[cur, rank]
            kid = torch.where(kid < size, kid, -1)  # children beyond this step's tree
            safe = kid.clamp(min=0)
            tried = alive & (chosen < 0) & (kid >= 0) & valid[rows, safe]
            x = tokens[rows, safe]
            accept = (x == best).float()
            one_hot = None if q_base is not None and point_mass is None else (
                law.new_zeros(batch, vocab).scatter_(1, x[:, None], 1.0))
            if q_base is None:
                q = one_hot
            elif point_mass is None:
                q = q_base
            else:
                q = torch.where(point_mass[rows, safe][:, None], one_hot, q_base)
            if not replacement:
                q = q.masked_fill(removed, 0.0)
                total = q.sum(-1, keepdim=True)
                q = torch.where(total > 0, q / total, torch.zeros_like(q))
            q_x = q[rows, x]
            ratio = (law[rows, x] / q_x).clamp(max=1.0)
            ratio = torch.where(q_x > 0, ratio, torch.zeros_like(ratio))
            accept = torch.where(greedy, accept, ratio)
            u = uniforms[rows, safe]
            take = tried & (u < accept)
            chosen = torch.where(take, kid, chosen)
            # The residual after a rejection (a skipped repeat, q(x) = 0, leaves p as it is). Where p - q has
            # no positive mass left, the reference drops x from p instead.
            update = tried & ~take & ~greedy & (q_x > 0)
            shrunk = (law - q).clamp_(min=0.0)
            mass = shrunk.sum(-1, keepdim=True)
            spent = update & (mass[:, 0] <= 0)
            law = torch.where((update & ~spent)[:, None], shrunk.div_(mass), law)
            law[rows, x] = torch.where(spent, 0.0, law[rows, x])
            if not replacement:
                removed[rows, x] |= update
        accepted = chosen >= 0
        cur = torch.where(accepted, chosen, cur)
        path[:, level] = torch.where(accepted, chosen, path[:, level])
        alive = alive & accepted
    length = (path >= 0).sum(-1)
    best = argmax[rows, cur]
    greedy_law = logits[rows, cur].float()
    law = torch.where(alive[:, None], probs[rows, cur], law)
    drawn = sample_from(law, uniforms[:, -1])
    next_token = torch.where(greedy | (best == NO_TOKEN), best, drawn)
    return BatchVerdict(path, length, next_token, torch.where(greedy[:, None], greedy_law, law), token_probs)
