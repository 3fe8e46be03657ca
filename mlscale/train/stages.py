"""Pipeline stages: where a plain model is split, and the stage modules traced from it.

Model code never imports this; it takes a finished plain model and splits it from outside.

*Where.* A model's repeated blocks are the largest ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential``
(by parameters) whose children all have one type, wherever it is (``transformer.h``, ``model.layers``,
tinylm's ``layers``; a Sequential model with mixed layers is its own container when nothing else is
found). The blocks are cut into P contiguous runs balanced by parameter count, counting the parameters
registered before the blocks with the first run and those after with the last (``balance``); a stage
begins at the first block of its run. ``--split-points FQN,...`` names the modules where stages 1..P-1
begin instead.

*How.* ``torch.distributed.pipelining.pipeline()`` traces the model with ``torch.export`` on one
microbatch of example inputs, with a ``SplitPoint.BEGINNING`` at every stage start, and cuts the graph
there: what runs before the first split (embeddings, masks, rotary tables) is stage 0's, what runs after
the last (final norm, head, the output's structure) the last stage's. Any model torch can export splits,
whatever its Python structure. A value that skips stages (rotary tables or a mask made by stage 0 and
read by every block) is handed on by each stage in between (``_pass_skip_connections_through``): torch's
schedules receive a stage's inputs from its neighbour only.

*What the traced stages are fixed up for* (``split_model``), so that checkpoints of a pipeline and of the
unsplit model are interchangeable:

- names: a stage module keeps the unsplit model's fully qualified names (``transformer.h.2.ln_1.weight``);
- parameters and buffers the forward never reads (a persistent buffer counting nothing, a spare
  parameter) are traced into no stage; the first stage keeps them, so they stay in checkpoints;
- non-persistent buffers, which the tracer re-registers as persistent, are non-persistent again;
- shared (tied) weights. ``pipeline()`` gives a parameter used by two stages to both as *separate
  deep copies* (``Pipe.replicated_params``), and leaves the original, unused, in the stage that had it
  first under its other name. Here every stage that uses a tied weight holds one tensor under all of its
  names (so its checkpoint part has the unsplit model's keys, and the tie within the stage is one
  storage); stages that do not use it hold none. The copies on different stages are the same weight:
  the strategy sums their gradients across those stages before each update (``Tie``), so each applies
  the same update and they stay equal; a checkpoint holds the weight once per name, and the assembled
  model ties it again (``retie``).

The last stage returns the traced graph's flat outputs; ``SplitModel.rebuild_output`` puts them back
into what the unsplit model returns (tensor, tuple, dict, a Hugging Face ``ModelOutput``), from the
output's pytree spec, so the task's loss takes the same structure under every strategy.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from mlscale.data.batches import Tree, as_call, call_model
from mlscale.data.batches import leaves as tensors_of
from mlscale.errors import UsageError, first_line
from mlscale.train.parallelize import BlockContainer, find_blocks


# -- where: the split points ----------------------------------------------------------------------------
def balance(weights: Sequence[int], parts: int) -> list[int]:
    """Cut ``weights`` into ``parts`` contiguous non-empty runs with the smallest largest sum (exact,
    by dynamic programming); returns the run lengths."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for end in range(k, n + 1):
            for start in range(k - 1, end):
                cost = max(best[k - 1][start], prefix[end] - prefix[start])
                if cost < best[k][end]:
                    best[k][end], cut[k][end] = cost, start
    lengths, end = [], n
    for k in range(parts, 0, -1):
        start = cut[k][end]
        lengths.append(end - start)
        end = start
    return lengths[::-1]


@dataclass(frozen=True)
class StagePlan:
    """Where each stage after the first begins (module names), and the blocks the split was made from."""

    starts: tuple[str, ...]
    blocks: BlockContainer | None
    given: bool  # the starts came from --split-points

    @property
    def stages(self) -> int:
        return len(self.starts) + 1


def plan_stages(model: nn.Module, stages: int, split_points: Sequence[str] = ()) -> StagePlan:
    """The stage starts: the ``split_points`` given (checked: modules of the model, one per stage after
    the first, in the order the model registers them), or the blocks balanced by parameter count."""
    blocks = find_blocks(model)
    if split_points:
        return StagePlan(_check_split_points(model, stages, split_points, blocks), blocks, given=True)
    if blocks is None:
        raise UsageError("--strategy pipeline found no repeated blocks in this model (a ModuleList, ModuleDict or "
                         "Sequential of modules of one type); name the modules where stages begin with "
                         "--split-points FQN,... or shard it with --strategy fsdp")
    if len(blocks.children) < stages:
        raise UsageError(f"bad value stages={stages}: the model has only {len(blocks.children)} block(s) to split "
                         f"(in {blocks.name or 'the model'})")
    weights = _block_weights(model, blocks)
    starts, at = [], 0
    for length in balance(weights, stages)[:-1]:
        at += length
        starts.append(blocks.fqn(blocks.children[at]))
    return StagePlan(tuple(starts), blocks, given=False)


def _block_weights(model: nn.Module, blocks: BlockContainer) -> list[int]:
    """Parameters per block, the ones registered before the blocks added to the first and those after to
    the last (a tied weight counted under each of its names: every stage that uses it holds a copy)."""
    prefixes = [blocks.fqn(child) + "." for child in blocks.children]
    weights = [0] * len(prefixes)
    seen_block = False
    for name, param in model.named_parameters(remove_duplicate=False):
        index = next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), None)
        if index is not None:
            seen_block = True
        else:
            index = len(prefixes) - 1 if seen_block else 0
        weights[index] += param.numel()
    return weights


def _check_split_points(model: nn.Module, stages: int, names: Sequence[str],
                        blocks: BlockContainer | None) -> tuple[str, ...]:
    given = ",".join(names)
    if len(names) != stages - 1:
        raise UsageError(f"bad value split-points={given!r}: {len(names)} name(s) for --stages {stages}; a split "
                         f"point is where a stage after the first begins, so give {stages - 1}")
    order = {name: index for index, (name, _) in enumerate(model.named_modules()) if name}
    for name in names:
        if name not in order:
            example = f" (its blocks: {blocks.fqn(blocks.children[0])}, {blocks.fqn(blocks.children[1])}, ...)" \
                if blocks else ""
            raise UsageError(f"bad value split-points={given!r}: the model has no module {name!r}{example}")
    for before, after in pairwise(names):
        if order[after] <= order[before] or after.startswith(before + "."):
            raise UsageError(f"bad value split-points={given!r}: {after!r} does not come after {before!r} in the "
                             "model; name the stage starts in the order the model runs them")
    return tuple(names)


# -- how: tracing and fixing up the stages -----------------------------------------------------------------
@dataclass(frozen=True)
class Tie:
    """One weight that several stages hold a copy of (a tied embedding and output head): its names in the
    unsplit model and the stages that use it. Their gradients are summed across those stages."""

    names: tuple[str, ...]
    stages: tuple[int, ...]


def alias_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter and buffer of ``model``, grouped by tensor: a tied weight's group has
    all of its names, in the model's order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(tensor), []).append(name)
    return [tuple(names) for names in groups.values()]


def retie(model: nn.Module, groups: Iterable[Sequence[str]]) -> nn.Module:
    """Make the names of each group one parameter again (the first name's), as in the unsplit model: a
    model assembled from a state dict holds a tied weight as separate tensors."""
    for names in groups:
        first = model.get_parameter(names[0]) if _is_parameter(model, names[0]) else None
        for name in names[1:]:
            if first is not None and _is_parameter(model, name):
                owner, leaf = _owner(model, name)
                owner.register_parameter(leaf, first)
    return model


class SplitModel:
    """A model traced and cut into stages (``split_model``): the stage modules until one is taken,
    the weights tied across stages, and how to rebuild the model's output from the last stage's."""

    def __init__(self, pipe: Any, plan: StagePlan, ties: list[Tie], aliases: list[tuple[str, ...]],
                 output_spec: pytree.TreeSpec | None, output_positions: list[int | None], stage_names: list[list[str]],
                 stage_params: list[int]) -> None:
        self.pipe: Any = pipe  # torch's Pipe; released by take_stage
        self.plan, self.ties, self.aliases = plan, ties, aliases
        self.output_spec, self.output_positions = output_spec, output_positions
        self.stage_names, self.stage_params = stage_names, stage_params

    def stage_module(self, index: int) -> nn.Module:
        assert self.pipe is not None, "the stages were released by take_stage"
        module: nn.Module = self.pipe.get_stage_module(index)
        return module

    def take_stage(self, index: int, device: torch.device, group: Any = None) -> Any:
        """The ``PipelineStage`` of stage ``index``; the other stages' modules are released (so this
        process keeps only its own stage's weights once the plain model is gone)."""
        split_gm = self.pipe.split_gm
        for name in [name for name in split_gm._modules if name != f"submod_pp_{index}"]:
            # The stage keeps the pipe's graph (which stage sends what to whom), and the graph its module:
            # without this every stage's weights would stay alive in every process.
            delattr(split_gm, name)
        stage = self.pipe.build_stage(index, device, group)
        self.pipe = None
        send_contiguous(stage)
        return stage

    def rebuild_output(self, stage_output: Any) -> Any:
        """What the unsplit model returns, from the last stage's output (a tensor or a tuple of them)."""
        assert self.output_spec is not None, "a model split on the meta device is only checked, never run"
        leaves = [stage_output if position is None else stage_output[position] for position in self.output_positions]
        return pytree.tree_unflatten(leaves, self.output_spec)

    def describe(self) -> str:
        parts = [f"stage {index}: {', '.join(names)} ({self.stage_params[index]:,} parameters)"
                 for index, names in enumerate(self.stage_names)]
        for tie in self.ties:
            stages = " and ".join(map(str, tie.stages))
            parts.append(f"tied across stages {stages}, kept in step: {' = '.join(tie.names)}")
        return "; ".join(parts)


def send_contiguous(stage: Any) -> None:
    """Make every tensor ``stage`` sends contiguous: its activations forward, its inputs' gradients back.
    torch's stage sends what the stage's code returns as it is, and gloo (like NCCL's copy) refuses a
    view: a block written sequence-first that hands its output back transposed, a user's module slicing
    a Hugging Face model's hidden states, a gradient through a transpose. A copy only where one is a view."""
    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        sends = getattr(stage, name)

        def contiguous(chunk: int, sends: Any = sends) -> list[Any]:
            return [op if op.tensor.is_contiguous() else
                    dist.P2POp(op.op, op.tensor.contiguous(), op.peer, op.group, op.tag) for op in sends(chunk)]

        setattr(stage, name, contiguous)


def split_model(model: nn.Module, plan: StagePlan, sample: Tree) -> SplitModel:
    """Trace ``model`` on ``sample`` (one microbatch of inputs: a tensor, a tuple or a dict of them, passed
    as the trainer passes them, ``batches.call_model``) and cut it at ``plan.starts``. A model
    torch cannot export, or a split that does not give ``plan.stages`` stages ending in the model's
    output, is refused with one line. The stage modules share ``model``'s tensors (all but the copies of a
    weight tied across stages), and ``model`` runs as before."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    aliases = alias_groups(model)
    non_persistent = {f"{name}.{leaf}" if name else leaf for name, module in model.named_modules()
                      for leaf in module._non_persistent_buffers_set}
    originals = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    output_spec, output_leaves = _output_spec(model, sample)
    try:
        with _quiet_tracing():
            args, kwargs = stage_call(sample)
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                            split_spec=dict.fromkeys(plan.starts, SplitPoint.BEGINNING))
    except Exception as exc:  # torch.export's errors have many types; each is this model's, not ours
        cause = exc.__cause__ or exc
        hint = "choose other --split-points or" if plan.given else "name other stage starts with --split-points or"
        raise UsageError(f"--strategy pipeline cannot trace this model with torch.export ({type(cause).__name__}: "
                         f"{first_line(cause)[:200]}); {hint} train it with --strategy fsdp") from None
    finally:
        _unmark_split_points(model, plan.starts)
    if pipe.num_stages != plan.stages:
        raise UsageError(f"bad value split-points={','.join(plan.starts)!r}: the traced model has {pipe.num_stages} "
                         f"stage(s), not {plan.stages} (a split point that runs first, or twice, or never)")
    _pass_skip_connections_through(pipe.split_gm)
    _refuse_skip_connections(pipe.split_gm.graph)
    _contiguous_boundaries(pipe.split_gm, plan.stages)
    positions = _output_positions(pipe.split_gm.graph, f"submod_pp_{plan.stages - 1}", output_leaves)
    modules = [pipe.get_stage_module(index) for index in range(plan.stages)]
    used = [_used_attributes(module) for module in modules]
    ties: list[Tie] = []
    for names in aliases:
        users = tuple(index for index, attributes in enumerate(used) if attributes.intersection(names))
        for index, module in enumerate(modules):
            if index in users:
                tensor = _get(module, next(name for name in names if name in used[index]))
            elif not users and index == 0:
                tensor = originals[names[0]]  # read by no forward: kept by the first stage
            else:
                for name in names:
                    _remove(module, name)  # e.g. the original of a tied weight pipeline() copied
                continue
            for name in names:
                _put(module, name, tensor, persistent=name not in non_persistent)
        if len(users) > 1 and isinstance(originals[names[0]], nn.Parameter):
            ties.append(Tie(names, users))
    known = set(originals)
    for module in modules:  # tensors the tracer lifted out of the code (constants): never checkpoint state
        for name, _ in list(module.named_buffers()):
            if name not in known:
                owner, leaf = _owner(module, name)
                owner._non_persistent_buffers_set.add(leaf)
    in_order = [f"{name}.{leaf}" if name else leaf for name, module in model.named_modules()
                for leaf in [*module._parameters, *module._buffers]]  # each module's own tensors, then its children's
    stage_names = [_describe_stage(plan, used[index], in_order) for index in range(plan.stages)]
    stage_params = [sum(p.numel() for p in module.parameters()) for module in modules]
    return SplitModel(pipe, plan, ties, [names for names in aliases if len(names) > 1], output_spec, positions,
                      stage_names, stage_params)


def stage_call(inputs: Tree) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments a pipeline is traced with and its first stage is called with: ``as_call``'s, keyword
    arguments in sorted order. torch's traced first stage binds its keyword inputs in sorted order but
    reads them back in the order they were given (torch 2.13), so inputs given in any other order
    reach the wrong parameters (token ids where a mask belongs)."""
    args, kwargs = as_call(inputs)
    return args, dict(sorted(kwargs.items()))


def _contiguous_boundaries(split_gm: fx.GraphModule, stages: int) -> None:
    """Every value a stage hands to the next is made contiguous where it is made, and every stage expects
    its inputs contiguous: torch's stages allocate their receive buffers with the strides the trace saw,
    so a view crossing a boundary (a block written sequence-first handing its output back transposed)
    makes gloo refuse the buffer itself ("input tensor has to be contiguous"). The gradients sent back are
    made contiguous as they are sent (``send_contiguous``)."""
    for index in range(stages):
        graph = split_gm.get_submodule(f"submod_pp_{index}").graph
        for node in graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and isinstance(value, torch.Tensor) and not value.is_contiguous():
                node.meta["val"] = _contiguous_like(value)
        output = next(node for node in graph.nodes if node.op == "output")

        def contiguous(node: fx.Node, graph: fx.Graph = graph, output: fx.Node = output) -> fx.Node:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor) or value.is_contiguous():
                return node
            with graph.inserting_before(output):
                copy = graph.call_method("contiguous", (node,))
            copy.meta = {**node.meta, "val": _contiguous_like(value)}
            return copy

        output.args = fx.map_arg(output.args, contiguous)
        split_gm.get_submodule(f"submod_pp_{index}").recompile()


def _contiguous_like(value: torch.Tensor) -> torch.Tensor:
    """A tensor with ``value``'s shape and dtype, laid out contiguously (only its metadata is read)."""
    return torch.empty(value.shape, dtype=value.dtype, device="meta", requires_grad=value.requires_grad)


def _pass_skip_connections_through(split_gm: fx.GraphModule) -> None:
    """torch.distributed.pipelining sends a stage's inputs from its neighbour only: a value one stage makes
    and a later, non-adjacent stage reads (Llama's rotary position embeddings, made before the first block
    and read by every block) fails in the first backward pass ("Backward of skip connections not supported
    yet"). So every stage in between hands the value on: it takes it as an input (or reuses the input it
    already has, when it reads the value too) and returns it as one more output, which the next stage
    reads instead. Its gradient comes back the same way, summed with the stage's own use of it."""
    graph = split_gm.graph
    stages = [node for node in graph.nodes if node.op == "call_module" and str(node.target).startswith("submod_pp_")]
    index = {node: position for position, node in enumerate(stages)}
    handed_by: dict[tuple[fx.Node, fx.Node], fx.Node] = {}  # (value, stage in between): what that stage returns
    for consumer in stages:
        while (skip := _first_skip(split_gm, consumer, index)) is not None:
            value, made, example = skip
            handed = value
            for between in stages[made + 1:index[consumer]]:
                if (value, between) not in handed_by:
                    handed_by[value, between] = _hand_on(split_gm, between, handed, example)
                handed = handed_by[value, between]
            consumer.replace_input_with(value, handed)
    graph.lint()
    split_gm.recompile()


def _first_skip(split_gm: fx.GraphModule, consumer: fx.Node,
                index: dict[fx.Node, int]) -> tuple[fx.Node, int, torch.Tensor] | None:
    """An input of ``consumer`` made two or more stages before it (looked up afresh: handing one value on
    can turn a stage's single output into a getitem the consumer reads instead); its making stage and its
    traced example. A value that is no tensor is left to ``_refuse_skip_connections``."""
    for position, value in enumerate(consumer.args):
        made = _stage_making(value, index) if isinstance(value, fx.Node) else None
        if made is None or made >= index[consumer] - 1:
            continue
        example = _placeholders(split_gm, consumer)[position].meta.get("val")
        if isinstance(example, torch.Tensor):
            return value, made, example
    return None


def _stage_making(value: fx.Node, index: dict[fx.Node, int]) -> int | None:
    while value not in index and value.op == "call_function" and value.target is operator.getitem:
        value = value.args[0]  # a getitem of a stage's outputs
    return index.get(value)


def _placeholders(split_gm: fx.GraphModule, stage: fx.Node) -> list[fx.Node]:
    return [node for node in getattr(split_gm, str(stage.target)).graph.nodes if node.op == "placeholder"]


def _hand_on(split_gm: fx.GraphModule, stage: fx.Node, value: fx.Node, example: torch.Tensor) -> fx.Node:
    """Make ``stage`` return ``value`` as its last output; the node in the outer graph that reads it."""
    module: fx.GraphModule = getattr(split_gm, str(stage.target))
    inner = module.graph
    placeholders = _placeholders(split_gm, stage)
    if value in stage.args:  # the stage reads it already: hand on the input it has
        passed = placeholders[stage.args.index(value)]
    else:
        with inner.inserting_after(placeholders[-1]):
            passed = inner.placeholder(f"handed_on_{value.name}")
        passed.meta["val"] = example
        stage.args = (*stage.args, value)
    output = next(node for node in inner.nodes if node.op == "output")
    returned = output.args[0]
    outer = split_gm.graph
    if isinstance(returned, (tuple, list)):
        position = len(returned)
        output.args = ((*returned, passed),)
    else:  # one output, read directly by the next stage: it becomes output 0 of two
        position = 1
        output.args = ((returned, passed),)
        readers = list(stage.users)
        with outer.inserting_after(stage):
            first = outer.call_function(operator.getitem, (stage, 0))
        first.meta.update(stage.meta)
        for reader in readers:
            reader.replace_input_with(stage, first)
    module.recompile()
    last_getitem = max((user for user in stage.users if user.target is operator.getitem),
                       key=lambda user: user.args[1], default=stage)
    with outer.inserting_after(last_getitem):
        handed = outer.call_function(operator.getitem, (stage, position))
    handed.meta["val"] = example
    return handed


def _refuse_skip_connections(graph: fx.Graph) -> None:
    """torch.distributed.pipelining sends a stage's inputs from its neighbour only; a value one stage
    makes and a later, non-adjacent stage reads (Llama's rotary position embeddings, made before the
    first block and read by every block) fails in the first backward pass ("Backward of skip connections
    not supported yet"). Refused here, before any process starts, in one line."""
    stage_of = {node.name: int(node.target.rsplit("_", 1)[1]) for node in graph.nodes
                if node.op == "call_module" and str(node.target).startswith("submod_pp_")}

    def producer(value: fx.Node) -> int | None:
        while value.op == "call_function" and value.args and isinstance(value.args[0], fx.Node):
            if value.name in stage_of:
                break
            value = value.args[0]  # through getitem of a stage's outputs
        return stage_of.get(value.name)

    for node in graph.nodes:
        if node.name not in stage_of:
            continue
        for value in node.all_input_nodes:
            made = producer(value)
            if made is not None and made < stage_of[node.name] - 1:
                raise UsageError(f"--strategy pipeline: stage {stage_of[node.name]} reads a value stage {made} makes "
                                 "(a skip connection past a neighbour, such as position embeddings shared by every "
                                 "block), which torch's pipeline schedules cannot run backward; use fewer --stages "
                                 "(2 has none) or --strategy fsdp")


# torch's tracer explains on stderr what it guards and guesses (logging), prints the partial graph of a
# trace that failed (torch.export's own print), and torch warns of its deprecations, on every rank; a trace
# that fails is reported in one line instead, and one that works needs no commentary.
_TRACER_LOGGERS = ("torch.fx", "torch._dynamo", "torch.export", "torch._export", "torch.distributed.pipelining")


@contextlib.contextmanager
def _quiet_tracing() -> Iterator[None]:
    names = {*_TRACER_LOGGERS, *(name for name in logging.root.manager.loggerDict if name.startswith(_TRACER_LOGGERS))}
    loggers = [logging.getLogger(name) for name in sorted(names)]  # children too: torch sets their levels
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore", FutureWarning)
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _unmark_split_points(model: nn.Module, starts: Iterable[str]) -> None:
    """Undo ``pipeline()``'s marks on the plain model (each start module's ``forward`` replaced by a method
    bound to the module): the model runs as before, and, no longer a reference cycle, is freed as soon as
    the trainer lets go of it rather than at the next garbage collection; under ``--memory-limit-mb``
    the other stages' weights would otherwise still count in the first step."""
    for name in starts:
        module = model.get_submodule(name)
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_orig_forward", None)


def _output_spec(model: nn.Module, sample: Tree) -> tuple[pytree.TreeSpec | None, int | None]:
    """The structure of what ``model`` returns and its number of tensors, from one forward on ``sample``
    (no gradients; the random number generators and the buffers, e.g. running statistics, are put back
    as they were, so training sees the model untouched). A model on the meta device is not run (its
    forward may read values; the launcher's check needs only the split): (None, None)."""
    tensors = tensors_of(sample)
    if any(t.is_meta for t in tensors) or any(t.is_meta for t in model.parameters()):
        return None, None
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    devices = [t.device for t in tensors[:1] if t.device.type == "cuda"]
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        output = call_model(model, sample)
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    leaves, spec = pytree.tree_flatten(output)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise UsageError("--strategy pipeline needs a model that returns tensors (in a tensor, tuple, dict or "
                         "ModelOutput); this one also returns other values; train it with --strategy fsdp")
    return spec, len(leaves)


def _output_positions(graph: fx.Graph, last_stage: str, count: int | None) -> list[int | None]:
    """Where each of the model's output tensors is in the last stage's output: its index there, or None
    when the stage returns that tensor alone. Refuses a model whose output a stage before the last makes."""
    output = next(node for node in graph.nodes if node.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    positions: list[int | None] = []
    for value in values:
        if isinstance(value, fx.Node) and value.op == "call_module" and value.target == last_stage:
            positions.append(None)
        elif (isinstance(value, fx.Node) and value.target is operator.getitem
              and getattr(value.args[0], "target", None) == last_stage):
            positions.append(int(value.args[1]))
        else:
            raise UsageError("--strategy pipeline needs every tensor the model returns to be made by its last "
                             "stage; this model returns one made earlier (an input, or an earlier layer's value); "
                             "move the split points with --split-points or train it with --strategy fsdp")
    if count is not None and len(positions) != count:
        raise UsageError(f"--strategy pipeline: the traced model returns {len(positions)} tensor(s), its forward "
                         f"{count}; train it with --strategy fsdp")
    return positions


def _used_attributes(module: nn.Module, scope: str = "") -> set[str]:
    """The fully qualified names of the tensors a stage's graph reads (its ``get_attr`` nodes)."""
    graph = getattr(module, "graph", None)
    used = {scope + node.target for node in graph.nodes if node.op == "get_attr"} if isinstance(graph, fx.Graph) \
        else set()
    for name, child in module.named_children():
        used |= _used_attributes(child, f"{scope}{name}.")
    return used


def _owner(module: nn.Module, name: str, create: bool = False) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    for part in path:
        child = module._modules.get(part)
        if child is None:
            if not create:
                raise AttributeError(name)
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, leaf


def _is_parameter(module: nn.Module, name: str) -> bool:
    try:
        owner, leaf = _owner(module, name)
    except AttributeError:
        return False
    return leaf in owner._parameters


def _get(module: nn.Module, name: str) -> torch.Tensor:
    owner, leaf = _owner(module, name)
    tensor = owner._parameters.get(leaf)
    if tensor is None:
        tensor = owner._buffers.get(leaf)
    if tensor is None:
        tensor = getattr(owner, leaf)
    assert isinstance(tensor, torch.Tensor), f"{name} is not a tensor of the stage"
    return tensor


def _remove(module: nn.Module, name: str) -> None:
    try:
        owner, leaf = _owner(module, name)
    except AttributeError:
        return
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)
    owner._non_persistent_buffers_set.discard(leaf)
    owner.__dict__.pop(leaf, None)


def _put(module: nn.Module, name: str, tensor: torch.Tensor, *, persistent: bool) -> None:
    _remove(module, name)
    owner, leaf = _owner(module, name, create=True)
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=persistent)


def _describe_stage(plan: StagePlan, used: set[str], tensor_names: list[str]) -> list[str]:
    """The parts of the model a stage runs, in the model's order: the parts around the blocks by name
    and the blocks as a span (``tok_embeddings, pos_embeddings, layers.0-1``)."""
    names: list[str] = []
    blocks = plan.blocks
    block_indices: list[int] = []
    parts = _parts_around(plan.blocks, tensor_names)
    for part in parts:
        if blocks is not None and part == blocks.name + ("." if blocks.name else ""):
            prefix = part
            block_indices = [i for i, child in enumerate(blocks.children)
                             if any(name.startswith(f"{prefix}{child}.") for name in used)]
            if block_indices:
                first, last = blocks.children[block_indices[0]], blocks.children[block_indices[-1]]
                names.append(f"{prefix}{first}" + (f"-{last}" if last != first else ""))
        elif any(name == part or name.startswith(part + ".") for name in used):
            names.append(part)
    return names or ["(no weights)"]


def _parts_around(blocks: BlockContainer | None, tensor_names: list[str]) -> list[str]:
    """The model's parts for a description: along the path from the model to its blocks, each level's
    other children (in registration order), and the blocks' container (ending in a dot) in its place."""
    if blocks is None:
        tops: list[str] = []
        for name in tensor_names:
            top = name.split(".")[0]
            if top not in tops:
                tops.append(top)
        return tops
    marker = blocks.name + ("." if blocks.name else "")
    path = blocks.name.split(".") if blocks.name else []
    parts: list[str] = []

    def walk(prefix: str, depth: int) -> None:
        children: list[str] = []
        for name in tensor_names:
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            child = rest.split(".")[0]
            if child not in children:
                children.append(child)
        for child in children:
            if depth < len(path) and child == path[depth]:
                if depth == len(path) - 1:
                    parts.append(marker)
                else:
                    walk(f"{prefix}{child}.", depth + 1)
            else:
                parts.append(f"{prefix}{child}")

    if not path:
        parts.append(marker)
    else:
        walk("", 0)
    return parts
