"""``RayTranscriber``: ``ASR.transcribe_iter`` as a Ray Data pipeline of segments:
decode tasks (``segment.py``) -> ASR actors (``actor.py``) -> the driver (``assemble.py``).
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import secrets
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from qasr.distributed import rows
from qasr.distributed.actor import Transcriber
from qasr.distributed.assemble import Collector
from qasr.distributed.config import EngineSpec, PoolConfig
from qasr.distributed.segment import display_name, location, segment_batch
from qasr.model.config import DEFAULT_MAX_SEGMENT_S, ModelConfig
from qasr.model.prompt import SUPPORTED_LANGUAGES
from qasr.results import Segment, Transcription
from qasr.transcribe.options import TranscribeOptions, model_language

log = logging.getLogger("qasr.distributed")
ACTOR_PREFIX = "qasr-asr"  # actors are named qasr-asr-<run>-p<pass>-<n>
TASK_RETRIES = 2


class RayTranscriber:
    """Transcribes inputs (paths or pyarrow URIs) on the connected Ray cluster, as one ``ASR`` would. Segments
    lost with an actor are redone by a further pass, up to ``max_passes``; then the input fails."""

    def __init__(self, spec: EngineSpec, pool: PoolConfig, max_passes: int = 3) -> None:
        self.spec = spec
        self.pool = pool
        self.max_passes = max_passes
        self.run_id = secrets.token_hex(3)
        self.passes = 0
        self.redone = 0
        self.repeats = 0
        self._config: ModelConfig | bool | None = None  # False: unreadable

    def check_language(self, language: str | None) -> str | None:
        """The canonical language name; ValueError as ``ASR`` would give."""
        config = self._model_config()
        return model_language(language, config.support_languages if config else SUPPORTED_LANGUAGES)

    def _model_config(self) -> ModelConfig | None:
        if self._config is None:
            self._config = self._read_model_config()
        return self._config or None

    def _read_model_config(self) -> ModelConfig | bool:
        config = Path(self.spec.model).expanduser() / "config.json"
        if not config.is_file():
            try:
                from huggingface_hub import hf_hub_download

                try:
                    config = Path(hf_hub_download(self.spec.model, "config.json", local_files_only=True))
                except Exception:  # noqa: BLE001
                    config = Path(hf_hub_download(self.spec.model, "config.json"))
            except Exception as exc:  # noqa: BLE001 - the actors report it if it matters
                log.warning("%s: could not read its config.json on the driver (%s); segments of at most %g s",
                            self.spec.model, type(exc).__name__, DEFAULT_MAX_SEGMENT_S)
                return False
        return ModelConfig.from_file(config)

    def transcribe_iter(self, audio: str | Sequence[str], options: TranscribeOptions | None = None, *,
                        language: str | None = None, context: str | None = None, max_new_tokens: int | None = None,
                        timestamps: str | None = None, progress: Callable[[float], None] | None = None,
                        segments: bool = False) -> Iterator[tuple[int, Transcription | Segment]]:
        """``(input index, result)`` in completion order, as ``ASR.transcribe_iter``; ``segments``: also each
        segment, before its Transcription."""
        sources = [audio] if isinstance(audio, str) else [str(a) for a in audio]
        options = self._options((options or TranscribeOptions()).given(
            language=language, context=context, max_new_tokens=max_new_tokens, timestamps=timestamps))
        if not sources:
            return
        collector = Collector([display_name(s) for s in sources], options.words, progress)
        todo = {i: set() for i in range(len(sources))}
        with _quiet_data_context():
            for number in range(1, self.max_passes + 1):
                self.passes = number
                if self.passes > 1:
                    log.warning("%d inputs lost segments with a worker; pass %d of %d redoes only those",
                                len(todo), self.passes, self.max_passes)
                before = collector.segments
                blocks = iter(self._dataset(sources, todo, options).iter_batches(batch_size=None,
                                                                                  batch_format="numpy"))
                try:
                    for block in blocks:
                        for r in rows.rows_of(block):
                            done = collector.add(r)
                            if done is not None:
                                if segments:
                                    yield from ((done[0], s) for s in done[1].segments)
                                yield done
                finally:  # closed early: stop the pass's tasks and actors now
                    close = getattr(blocks, "close", None)
                    if close is not None:
                        close()
                if self.passes > 1:
                    self.redone += collector.segments - before
                self.repeats = collector.repeats
                todo = collector.incomplete()
                if not todo:
                    return
        for i, held in todo.items():
            yield i, Transcription("", "", 0.0, source=collector.names[i],
                                   error=f"{collector.names[i]}: not finished after {self.max_passes} passes "
                                         f"({len(held)} segments done); its workers kept dying, see the Ray logs")

    def _options(self, options: TranscribeOptions) -> TranscribeOptions:
        self.check_language(options.language)  # type: ignore[arg-type]
        if options.words and self.spec.aligner is None:
            log.warning("word timestamps need a forced aligner (--aligner PATH): giving segment times instead")
            options = options.given(timestamps="segment")
        config = self._model_config()
        return options.for_model(config)

    def _dataset(self, sources: list[str], todo: dict[int, set[int]], options: TranscribeOptions):  # noqa: ANN202
        import ray.data

        items = [{"item": i, "given": sources[i], "source": location(sources[i]), "skip": json.dumps(sorted(held))}
                 for i, held in todo.items()]
        pool = self.pool
        names = itertools.count()
        label = f"{ACTOR_PREFIX}-{self.run_id}-p{self.passes}"
        remote_args: dict = {"max_restarts": -1, "max_task_retries": TASK_RETRIES}
        strategy = _actor_pool(pool, remote_args)
        # deprecated, but nothing else bounds retries or names actors
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            ds = ray.data.from_items(items, override_num_blocks=len(items))
            ds = ds.map_batches(segment_batch, fn_kwargs={"options": options}, batch_size=1,
                                num_cpus=pool.decode_cpus, max_retries=TASK_RETRIES)
            return ds.map_batches(Transcriber, fn_constructor_kwargs={"spec": self.spec, "options": options},
                                  batch_size=pool.batch_size, num_cpus=pool.actor_cpus, num_gpus=pool.actor_gpus,
                                  compute=strategy, ray_remote_args_fn=lambda: {"name": f"{label}-{next(names)}"},
                                  **remote_args)


def _actor_pool(pool: PoolConfig, remote_args: dict):  # noqa: ANN202 - a ray.data.ActorPoolStrategy
    from ray.data import ActorPoolStrategy

    kwargs: dict = {"min_size": pool.min_actors, "max_size": pool.max_actors}
    if "enable_true_multi_threading" in inspect.signature(ActorPoolStrategy).parameters:
        kwargs.update(max_concurrent_calls_per_actor=pool.calls_per_actor, enable_true_multi_threading=True,
                      max_tasks_in_flight_per_actor=pool.calls_per_actor)
    else:  # older Ray
        remote_args["max_concurrency"] = pool.calls_per_actor
    return ActorPoolStrategy(**kwargs)


# a failed block leaves its segments to the next pass
_DATA_SETTINGS = {"enable_progress_bars": False, "max_errored_blocks": -1, "max_consecutive_actor_init_deaths": 3}


@contextmanager
def _quiet_data_context() -> Iterator[None]:
    from ray.data import DataContext

    ctx = DataContext.get_current()
    settings = {k: v for k, v in _DATA_SETTINGS.items() if hasattr(ctx, k)}
    saved = {k: getattr(ctx, k) for k in settings}
    for key, value in settings.items():
        setattr(ctx, key, value)
    loggers = {logging.getLogger("ray.data"): logging.WARNING,
               logging.getLogger("ray.data._internal.progress"): logging.ERROR}
    levels = {logger: logger.level for logger in loggers}
    for logger, level in loggers.items():
        logger.setLevel(max(level, logger.getEffectiveLevel()))
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(ctx, key, value)
        for logger, level in levels.items():
            logger.setLevel(level)
