"""Builds an Engine from checkpoint paths: target (+ drafter in process), tokenizer, tree backends."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ddtree.engine.backends import LocalDrafter, LocalTree
from ddtree.engine.engine import Engine, EngineConfig
from ddtree.engine.runner import GraphBuckets
from ddtree.engine.target import LocalTarget
from ddtree.models import sources
from ddtree.prompting import PromptEncoder
from ddtree.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """"auto": bfloat16 on a GPU, float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (expected auto or one of {sorted(DTYPES)})") from None


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


@dataclass(frozen=True)
class ModelSetup:
    target: str                    # target checkpoint directory
    drafter: str | None = None     # DFlash checkpoint directory, loaded in process (None: remote or none)
    drafter_layer_ids: tuple[int, ...] = ()  # feature layers when the drafter is remote
    device: str = "auto"
    dtype: str = "auto"
    max_context: int | None = None  # default: the target's max_position_embeddings
    tree_backend: str = "auto"      # in-process tree build: reference | cpu | cuda | auto (by device)
    eager: bool = False             # no CUDA graphs: every verify launched op by op (the reference)
    graph_buckets: GraphBuckets | None = None  # None: GraphBuckets.default from the engine config
    draft_block_size: int = 0       # the drafter's block (a chain's rows) when it is remote


def feature_layers(setup: ModelSetup) -> tuple[int, ...]:
    if setup.drafter:
        return sources.drafter_config(setup.drafter).target_layer_ids
    return tuple(setup.drafter_layer_ids)


def graph_buckets(setup: ModelSetup, config: EngineConfig) -> GraphBuckets | None:
    """The verify graphs to capture: none when eager, else the setup's or the defaults for the
    engine's batch and budget limits and the drafter's block."""
    if setup.eager:
        return None
    if setup.graph_buckets is not None:
        return setup.graph_buckets
    block = setup.draft_block_size
    if setup.drafter:
        block = sources.drafter_config(setup.drafter).block_size
    return GraphBuckets.default(config.scheduler.max_running, config.budget.max_budget, block)


def load_target(setup: ModelSetup, config: EngineConfig, process_group=None) -> LocalTarget:
    device = resolve_device(setup.device)
    return LocalTarget.load(setup.target, dtype=resolve_dtype(setup.dtype, device), device=device,
                            num_pages=config.scheduler.num_pages, page_size=config.scheduler.page_size,
                            max_context=setup.max_context, feature_layers=feature_layers(setup),
                            process_group=process_group, graph_buckets=graph_buckets(setup, config))


def local_drafter(setup: ModelSetup, target: LocalTarget, config: EngineConfig) -> LocalDrafter:
    from ddtree.models.dflash import DrafterContextCache

    model = target.model
    if model.tp.enabled:
        raise ValueError("an in-process drafter needs --tp 1 (use the drafter service with tensor parallelism)")
    # a synthetic target is one rank's vocabulary shard: the drafter gets its own whole vocabulary
    embed, head = (sources.synthetic_vocab(setup.target, dtype=model.dtype, device=model.device)
                   or (model.embed_tokens, model.lm_head))
    drafter = sources.load_drafter(setup.drafter, embed_tokens=embed, lm_head=head, dtype=model.dtype,
                                   device=model.device)
    cache = DrafterContextCache(drafter.config, num_pages=config.scheduler.num_pages,
                                page_size=config.scheduler.page_size, device=model.device, dtype=model.dtype)
    graphs = None
    if model.device.type == "cuda" and not setup.eager:
        from ddtree.engine.draft_runner import DraftGraphs, draft_buckets

        graphs = DraftGraphs(drafter, cache, draft_buckets(config.scheduler.max_running, target.max_context,
                                                           config.scheduler.page_size), top_k=config.max_top_k)
    return LocalDrafter(drafter, cache, name=sources.name(setup.drafter), graphs=graphs)


def tree_backend(setup: ModelSetup) -> str:
    """"auto": the native backend matching the tensors' device (ddtree.tree's own choice)."""
    if setup.tree_backend != "auto":
        return setup.tree_backend
    from ddtree import native

    try:
        native.load()
        return "auto"
    except native.NativeExtensionMissing:
        log.warning("native extension missing: in-process tree build uses the reference backend")
        return "reference"


def build_local_engine(setup: ModelSetup, config: EngineConfig = EngineConfig(), *, target: LocalTarget | None = None,
                       drafter=None, tree=None, tracer=None, on_fatal=None) -> Engine:
    """Target (+ in-process drafter when setup.drafter) + tokenizer + in-process tree build.

    `drafter`/`tree` override the in-process ones (remote backends: ddtree.drafter.client,
    ddtree.treebuild.client, wired by ddtree.verify.peers).
    """
    target = target or load_target(setup, config)
    if drafter is None and setup.drafter:
        drafter = local_drafter(setup, target, config)
    files = sources.checkpoint_dir(setup.target)
    tokenizer = load_tokenizer(files, target.vocab_size)
    prompts = PromptEncoder.load(files, tokenizer)
    local_tree = LocalTree(tree_backend(setup))
    return Engine(target, tokenizer, config, drafter=drafter, tree=tree or local_tree, local_tree=local_tree,
                  tracer=tracer, on_fatal=on_fatal, prompts=prompts)
