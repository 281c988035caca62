"""Pretrained weights from safetensors files, checked, then read shard by shard into a plan.

:func:`load` maps each planned parameter to a tensor of a (possibly sharded) Hugging
Face style checkpoint, through renames, slices, reshapes, transposes and scales, or to
several (:class:`Stack`, :class:`Concat`: scanned layers, fused projections), and
reads from the
memory-mapped files only the bytes of the shards this process's devices own. Its
result feeds ``existing=`` of :func:`meshinit.nnx.init` (or ``linen``/``eqx``, or
:func:`meshinit.materialize`), which then makes only what the files lack::

    loaded = meshinit.safetensors.load(meshinit.nnx.plan(factory), files,
                                       names=hf_names, missing="skip")
    model = meshinit.nnx.init(factory, existing=loaded)

Files are untrusted: every one is checked as the format requires, and by the
``safetensors`` package itself, before a byte of data is read or allocated
(:mod:`meshinit._checkpoint.store.listing`, :mod:`meshinit._checkpoint.store.source`). Every stored
tensor is accounted for:
one that no plan path claims is named (:class:`~meshinit.UnusedTensorWarning`), and
:func:`inventory` shows what a load would read, skip and leave, reading nothing.
"""

from __future__ import annotations

from typing import Any

import jax

from ._checkpoint.layout.parts import Concat as Concat
from ._checkpoint.layout.parts import Fill as Fill
from ._checkpoint.layout.parts import Pad as Pad
from ._checkpoint.layout.parts import Stack as Stack
from ._checkpoint.layout.parts import Tensor as Tensor
from ._checkpoint.maps.framework import Checkpoint as Checkpoint
from ._checkpoint.maps.framework import FrameworkMap as FrameworkMap
from ._checkpoint.read import load as _loader
from ._checkpoint.read import survey as _survey
from ._checkpoint.read.survey import Inventory as Inventory
from ._checkpoint.store import aio as _aio
from ._checkpoint.write import save as _saver
from ._checkpoint.write.save import Export as Export
from ._errors import PlanError
from ._plan.plan import Plan
from ._run import agree as _agree

__all__ = [
    "Checkpoint",
    "Concat",
    "Export",
    "Fill",
    "FrameworkMap",
    "Inventory",
    "Pad",
    "Stack",
    "Tensor",
    "inventory",
    "load",
    "save",
]

# documented and shown as meshinit.safetensors.X
for _public in (Tensor, Stack, Concat, Fill, Pad, FrameworkMap, Checkpoint, Inventory, Export):
    _public.__module__ = __name__


def inventory(
    plan: Plan,
    files: Any,
    *,
    names: Any = None,
    storage_options: Any = None,
    timeout: float | None = _aio.TIMEOUT,
) -> Inventory:
    """What :func:`load` would read, skip and leave, checking every file but reading no
    data: the one place to see a name map's effect before a long load.

    Works on plans over abstract meshes too: a name map can be checked before the
    hardware exists.

    Args:
      plan: the plan to fill (:func:`meshinit.plan`, ``meshinit.nnx.plan(factory)``).
      files: as for :func:`load`.
      names: as for :func:`load`.
      storage_options: as for :func:`load`.
      timeout: as for :func:`load`.

    Returns:
      An :class:`Inventory`: plan paths loaded (and from which tensor), skipped (names
      gives None) and missing (no file holds their tensor), and the unused tensors.

    Raises:
      PlanError: a file fails the format's checks, ``names`` is malformed or maps a
        path that is not planned, or a tensor's shape or dtype does not fit its path;
        a float8 weight planned wider that :func:`load` would refuse, or a
        ``config.json`` it would consult and cannot read (as :func:`load` says); all
        of them at once.
      TypeError: ``files`` or ``names`` are of the wrong kind.

    Examples:
      >>> from safetensors.numpy import save_file
      >>> save_file({"embed": np.zeros((256, 64), np.float32),
      ...            "layers.0.up": np.zeros((64, 256), np.float32),
      ...            "lm_head": np.zeros((64, 256), np.float32)}, "ckpt.safetensors")
      >>> print(meshinit.safetensors.inventory(
      ...     plan, "ckpt.safetensors", names=[(r"head", "lm_head")]))
      1 file: 3 plan paths loaded
      skipped (names= gives None): 0
      missing (no file holds them): 1 layers.1.up <- 'layers.1.up'
      unused (no plan path claims them): 0
      dequantized (float8 x block scales; MXFP4): 0
    """
    what = "meshinit.safetensors.inventory"
    with _aio.session(_timeout(timeout)):
        survey = _survey.survey(plan, files, names, what, storage_options)
    if survey.problems:
        raise PlanError(survey.problems, header="meshinit.safetensors.inventory:")
    return survey.inventory


def load(
    plan: Plan,
    files: Any,
    *,
    names: Any = None,
    missing: str = "error",
    unused: str = "warn",
    storage_options: Any = None,
    max_inflight_bytes: int = 1 << 30,
    progress: bool | None = None,
    timeout: float | None = _aio.TIMEOUT,
    fan_out: bool | None = None,
) -> dict[str, jax.Array]:
    r"""Reads the plan's parameters from safetensors files onto their planned shardings.

    Every file is checked first, as the format requires and by the ``safetensors``
    package itself (header length within the file and the format's cap, UTF-8 JSON,
    known dtypes, offsets that tile the data exactly, no name twice), and every plan
    path is matched to its tensor, before a byte of data is read or allocated. Then
    each process reads, from memory-mapped files, only the blocks its own devices'
    shards hold, each distinct block once (and of a stacked or concatenated parameter,
    only the parts the block reaches), so it works under ``jax.distributed`` and a
    host never holds a full copy of a sharded parameter. Each process records the
    bytes it read as the ``jax.monitoring`` scalar ``/meshinit/safetensors/bytes_read``,
    once per load. On any failure, ``KeyboardInterrupt`` included, every array it made
    is deleted.

    Args:
      plan: the plan to fill, from :func:`meshinit.plan` or an adapter's ``plan``
        (``meshinit.nnx.plan(factory)``); its meshes must be concrete.
      files: a ``.safetensors`` path, a list of them, or a directory holding the
        ``*.safetensors`` files of a sharded checkpoint (hidden files skipped; where it
        has a ``model.safetensors.index.json``, only the files the index lists, which
        must hold what it says). Or URLs, listed and read the same way, each process
        fetching only the byte ranges its devices own: ``s3://bucket/prefix/``,
        ``gs://bucket/prefix/``, ``hf://org/model`` (``hf://org/model@revision/folder``)
        and ``https://`` URLs of single files. Credentials and endpoints come from
        where each client reads them (the environment, config files, the Hub's token).
      names: which tensors fill each plan path: a name, a :class:`Tensor` (a name
        with a slice, a reshape, a transpose, a scale, an offset), a :class:`Stack`
        or :class:`Concat` of parts (scanned layers, fused projections), a
        :class:`Fill` (a constant) or a :class:`Pad` (a part padded to a larger
        shape), or None for a path the files do not hold.
        Given as a callable (``names(path)``), a Mapping from plan paths, or a rule
        table: ordered ``(regex, target)`` pairs, the first full match of the path
        winning, whose target names may use the match's groups (``\1``). A path that
        a Mapping lacks or no rule matches, and every path by default, is looked up
        under its own name.
      missing: ``"error"`` (default): a named tensor that no file holds is an error.
        ``"skip"``: such paths are left out of the result, for ``existing=`` and an
        init to make.
      unused: what to do with stored tensors that no plan path claims (or, with
        ``missing="skip"``, that only skipped paths would read): ``"warn"``
        (default: one :class:`~meshinit.UnusedTensorWarning` naming them all),
        ``"error"`` (a :class:`~meshinit.PlanError` naming them, before anything is
        read) or ``"ignore"``.
      storage_options: for URLs, passed to the client: ``obstore``'s store options
        (``endpoint``, ``access_key_id``, ``client_options``, ``retry_config``, ...);
        for ``hf://``, also ``endpoint``, ``token`` (``False`` sends none, not even
        ``HF_TOKEN``'s) and ``headers``. Each key is checked against the options the
        installed obstore knows before any request: an unknown one is a PlanError
        naming it and the known ones. ``http://`` URLs need no ``allow_http``.
      max_inflight_bytes: for URLs, the most bytes of memory that fetched bytes hold
        before they are placed (default 1 GiB): with them, the host's memory bound.
        The blocks of a parameter that share pages of memory (column blocks of a
        row-major tensor each touch every page of it) are fetched together, once, so
        where one group of them is larger, it is the bound.
      timeout: for URLs, the seconds one request may take, the client's retries and
        meshinit's included (default 120; None: no deadline). Past it, the request is
        cancelled and the load fails naming the URL and the bytes. Ctrl-C cancels
        every request in flight at once.
      fan_out: under ``jax.distributed``, whether a stored block that devices of
        several processes hold (a parameter replicated across hosts, whole or per
        shard) is fetched once for the whole job: ``None`` (default) and ``True`` do
        so wherever more than one process holds a block. Its bytes are split among
        those processes along the stored tensor's outer dimension, each process
        fetching only its share, and one compiled all-gather per signature (not per
        layer) fills every replica, in batches of at most ``max_inflight_bytes`` per
        process. The values are the same bits as each process reading it all.
        ``False``: each process fetches every block its devices hold. With one
        process it changes nothing. Each process records the bytes its shards got
        from other processes' reads as the ``jax.monitoring`` scalar
        ``/meshinit/safetensors/bytes_from_peers``. Every process must pass the same
        ``fan_out`` (None and True alike) and ``max_inflight_bytes``: the processes
        compare them, the paths read, the staging and the batches before the first
        collective, and a difference is a PlanError on every process.
      progress: a bar (tqdm, on stderr) of the bytes read (of URLs: fetched) and bytes
        per second: ``True``, ``False``, or ``None`` (default: where stderr is a
        terminal, shown at once for a load of at least 1 GiB, else once it has run a
        second: a slow disk or a network filesystem makes a small load long too).

    Returns:
      Plan path -> ``jax.Array`` on the entry's sharding, cast to its dtype (within a
      kind: floats to floats, ints to ints), for every path that a tensor fills. A
      float8 weight with its ``<name>_scale_inv`` beside it (DeepSeek-V3, Kimi K2,
      Qwen3-FP8 as published), planned as bfloat16, float16 or float32, is
      dequantized on the device with the bits of DeepSeek's ``weight_dequant``:
      ``planned(float32(w) * float32(scale[i // b0, j // b1]))``; read through
      ``Tensor(name, dequantize=False)``, it is cast as stored and a scale beside it
      is not applied (it is then unused, unless a plan path claims it). A
      typed PRNG key (an nnx ``Rngs`` stream's ``key<fry>``) is read from its stored
      key data (``jax.random.key_data``: uint32, the key's shape plus the
      implementation's trailing dimensions) and given back as a key array of the
      plan's implementation.

    Raises:
      PlanError: all at once, before anything is read: each file that fails a check
        (naming the file, the tensor and what is wrong), each missing tensor (with
        ``missing="error"``), unused tensor (with ``unused="error"``), tensor whose
        shape after the transforms is not the planned one or whose dtype cannot be
        cast to the planned one; a float8 weight (``F8_E4M3``, ``F8_E5M2``)
        planned as a wider float that cannot be read dequantized: no
        ``<name>_scale_inv`` beside it, whatever config.json says (a plain cast
        only where asked for by name: ``Tensor(name, dequantize=False)``), a scale
        that is not F32 or BF16 or whose shape is not ``(ceil(R / b0),
        ceil(C / b1))`` for the block (``quantization_config.weight_block_size``, else
        128x128; the config and the shapes disagreeing), a weight that is not 2-D, or
        one read through an ``out_shape`` inside a ``Stack``, ``Concat`` or ``Pad``,
        through ``scale=``/``offset=``, or joined with parts whose views step through
        their stored tensors differently (not supported yet; plan it as float8 to read
        the stored values as they are); a ``config.json`` that the load consults (for
        a float8 or MXFP4 weight planned wider, or a framework's map) and cannot
        read: unreadable, over 16 MiB, not JSON (a truncated download; naming the
        parse error), not an object, or whose ``quantization_config`` (top level or
        ``text_config.``) is not an object, or holds a ``quant_method`` that is not a
        string or a ``weight_block_size`` that is not a positive whole number or a
        list of one or two; a malformed ``names``; a plan on abstract meshes.
        While reading: a value that does not fit the planned dtype (an int out of
        range, a float that overflows, a dequantized product that overflows; a block
        scale so small that its products would be float32 subnormals; a block scale
        that is NaN or infinite, a damaged file), checked only where the view reads
        it, or a file changed since it was checked.
      TypeError: ``files``, ``names``, ``missing`` or ``unused`` are of the wrong kind.
      PeerFailure: under ``jax.distributed``, another process's load failed (this
        process's arrays deleted); see the Reliability page, "Processes".

    Examples:
      >>> names = [  # nnx path -> Hugging Face name; (out, in) -> (in, out)
      ...     (r"embed\.embedding", "model.embed_tokens.weight"),
      ...     (r"layers\.(\d+)\.mlp\.(up|down)\.kernel",
      ...      Tensor(r"model.layers.\1.mlp.\2_proj.weight", permute=(1, 0))),
      ...     (r"head\.kernel", None),  # new: made by the init
      ... ]
      >>> loaded = meshinit.safetensors.load(plan, "ckpt/", names=names)  # doctest: +SKIP

      (The load needs a downloaded Hugging Face checkpoint in ``ckpt/``: not run in the tests.)
    """
    what = "meshinit.safetensors.load"
    # Collective: under jax.distributed a process whose copy of a file fails its checks,
    # or whose arguments are bad, fails every process (through the agreement, before
    # any collective), and none returns arrays that lack its shards.
    with _agree.collective(what):
        if missing not in ("error", "skip"):
            raise TypeError(f'missing must be "error" or "skip", got {missing!r}')
        if unused not in ("warn", "error", "ignore"):
            raise TypeError(f'unused must be "warn", "error" or "ignore", got {unused!r}')
        if not (isinstance(max_inflight_bytes, int) and max_inflight_bytes > 0):
            raise TypeError(
                f"max_inflight_bytes must be a positive int, got {max_inflight_bytes!r}"
            )
        if fan_out not in (None, True, False) or not isinstance(fan_out, bool | None):
            raise TypeError(f"fan_out must be None, True or False, got {fan_out!r}")
        with _aio.session(_timeout(timeout)):
            options, budget = storage_options, max_inflight_bytes
            arrays = _loader.load(
                plan, files, names, missing, unused, what, options, budget, progress, fan_out
            )
            _agree.keep(arrays.values())
    return arrays


def save(
    arrays: Any,
    dest: Any,
    *,
    names: Any = None,
    dtype: Any = None,
    quantize: str | None = None,
    modules_to_not_convert: Any = None,
    max_shard_size: int | str | None = None,
    config: Any = None,
    storage_options: Any = None,
    max_inflight_bytes: int | None = None,
    overwrite: bool = False,
    progress: bool | None = False,
) -> Export:
    r"""Writes sharded arrays as a Hugging Face safetensors checkpoint, every process
    writing its own files at once, no host ever holding the model.

    Each stored tensor is made on the devices from the parameters that
    :func:`load` would fill from it (``names=`` read in reverse), gathered onto the
    devices of every process that holds them (a compiled reshard: bytes move between
    devices, never through a host), and written by one of those processes: the files
    are cut so that each process writes whole files of its own, shared out for
    balance, front to back, each device-to-host copy overlapping the writes. Host
    memory per process stays within ``max_inflight_bytes``. Under ``jax.distributed``
    every process must call it with the same arguments (they compare them first).

    The commit is atomic: ``config.json``, then the index (or a lone
    ``model.safetensors``, renamed into place) are written last, by process 0, once
    every process has agreed that its files are written. A failure on any process
    makes every process raise (``PlanError`` naming the object where it failed,
    :class:`~meshinit.PeerFailure` on the others); then every file of the export is
    removed and every multipart upload aborted, so nothing is left under ``dest``
    that a loader would take for a checkpoint.

    Args:
      arrays: what :func:`load` returns (plan path -> ``jax.Array``), any pytree of
        arrays (under its dot-joined paths: ``materialize``'s nested dicts, linen
        variables), or an nnx Module or State (its ``nnx.Param`` paths).
      dest: a local folder (created at the first write), or an ``s3://bucket/prefix/`` or
        ``gs://bucket/prefix/`` URL.
      names: as for :func:`load`, read in reverse: each stored tensor is written from
        the parameters that read it. A name renames; a :class:`Tensor`'s ``index``,
        ``shape``, ``permute`` and ``out_shape`` are undone (a reshape's stored shape
        read as its runs: each run of given sizes one stored axis, each ``-1`` one,
        so ``shape=(heads, head_dim, -1)`` writes a ``(heads * head_dim, d)`` tensor);
        a :class:`Stack` writes one tensor per index of its axis, a :class:`Concat` its
        parts, a :class:`Pad` its part without the padding, a :class:`Fill` nothing.
        ``meshinit.maxtext.names(config)`` writes with MaxText's own saving hooks;
        ``meshinit.tunix.names(model_config)`` with tunix's map read from the
        parameters' side, refusing by name what does not invert.
        None: every array under its own path.
      dtype: a floating dtype every floating tensor is cast to on the devices (round to
        nearest even), or None: as the arrays are.
      quantize: None, or ``"fp8"``: DeepSeek's published format, computed on the
        devices: ``float8_e4m3fn`` weights and a float32 ``<name>_scale_inv`` of shape
        ``[ceil(rows / 128), ceil(cols / 128)]``, with the bits of DeepGEMM's
        ``per_block_cast_to_fp8``, for 2-D weights and stacked per-expert weights;
        ``config.json`` gets its ``quantization_config``.
      modules_to_not_convert: with ``quantize="fp8"``, the modules left as they are
        (None: 1-D tensors, embeddings, the LM head, norms, biases and router gates,
        as Qwen's FP8 releases list them).
      max_shard_size: the most bytes of tensors in one file (an int, or a string as
        transformers takes it: ``"5GB"``, ``"2GiB"``), unless one tensor is larger.
        None: 5 GB, transformers' default. Under ``jax.distributed`` the tensors are
        shared out among the processes first (the largest first, each to the least
        loaded process that holds it), then each process's are cut into files of its
        own, so every process writes its share at any file size.
      config: a dict, or anything with ``to_dict()`` (a transformers config), written
        as ``config.json``. With ``tie_word_embeddings`` in it, ``lm_head.weight`` is
        not written, as transformers drops the tied copy.
      storage_options: as for :func:`load`.
      max_inflight_bytes: the most bytes of gathered tensors a process holds at once,
        on its devices and its host together (default 1 GiB; where one tensor is
        larger, it is the bound).
      overwrite: replace a checkpoint already under ``dest`` (its files, its index and
        its ``config.json`` are removed first). False (default): such a ``dest`` is
        refused.
      progress: a bar (tqdm, on stderr) of the bytes this process writes: ``True``,
        ``False`` (default), or ``None`` (as :func:`load` decides).

    Returns:
      An :class:`Export`: the files, the total size, the bytes each process wrote. Each
      process also records its bytes as the ``jax.monitoring`` scalar
      ``/meshinit/safetensors/bytes_written``.

    Raises:
      PlanError: all at once, before a byte is written: a stored tensor the parameters
        cover only in part, or twice; a ``scale``/``offset`` with no saving hook; a
        layout the export cannot undo (naming why); a plan path without an array;
        two parameters that write one name; a ``dest`` that already holds a checkpoint
        without ``overwrite=True``. While writing: the object that failed, and why.
      TypeError: an argument of the wrong kind.
      PeerFailure: under ``jax.distributed``, another process's export failed.

    Examples:
      >>> names = [(r"layers\.(\d+)\.mlp\.(up|down)\.kernel",
      ...           Tensor(r"model.layers.\1.mlp.\2_proj.weight", permute=(1, 0)))]
      >>> meshinit.safetensors.save(model, "export/", names=names,
      ...                           config=hf_config)  # doctest: +SKIP
    """
    what = "meshinit.safetensors.save"
    with _agree.collective(what):
        with _aio.session(_aio.TIMEOUT):
            return _saver.save(
                arrays,
                dest,
                names,
                dtype,
                quantize,
                modules_to_not_convert,
                max_shard_size,
                config,
                storage_options,
                max_inflight_bytes,
                overwrite,
                progress,
                what,
            )


def _timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise TypeError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)
