"""`Content-Type: application/jsonlines` on `/invocations`: one output line per input line, streamed.

Lines are read without holding the model: a chunk of ``ARBITER_JSONL_CHUNK`` lines (or about
``ARBITER_MAX_BODY_MB`` of them) is read first, then scored under a compute slot taken for that
chunk alone, so a slow uploader never blocks other requests. Every line read gets exactly one
record, in order (``{"line", "id", "result" | "error"}``); what stops the stream (the body limit, a
stalled client, a fault) is written as one last error record after them, and the stream is closed
cleanly.
"""

from __future__ import annotations

from aiohttp import web

from adapter.admission import Admission
from adapter.bodies import body_pieces
from adapter.budgets import Cancellable
from adapter.metrics import Metrics
from adapter.state import REQUEST_LOG, RequestLog, State
from adapter.streaming import OPEN_STREAM, OpenStream
from arbiter.engine import Budget, Engine
from arbiter.errors import ArbiterError, EngineFailure, PayloadTooLarge, RequestTimeout, ServerBusy
from arbiter.lines import LineReader, Numbered, encode_record, score_lines
from arbiter.logging import get_logger
from arbiter.scorer import Scorer
from arbiter.settings import MB, ServerSettings

Batch = list[Numbered]
log = get_logger("arbiter.http")


def error_record(number: int, error: ArbiterError) -> bytes:
    return encode_record(number, None, error)[0]


def score_chunk(engine: Scorer, metrics: Metrics, batch: Batch) -> tuple[bytes, int, int]:
    """Score and serialize one chunk of lines: one output line per input line, whatever happens."""
    try:
        written = score_lines(engine, list(batch), metrics.observe_decision)
    except Exception as exc:  # a fault outside any one decision: every line of the chunk says so
        if isinstance(exc, ArbiterError):
            failure = exc
        else:
            log.error("chunk_failed", error=repr(exc), exc_info=exc)
            failure = EngineFailure(
                f"this chunk could not be scored ({type(exc).__name__}); see the server log"
            )
        written = [encode_record(n, None, failure) for n, _ in batch]
    tokens = sum(o.prompt.input_tokens for _, o in written if not isinstance(o, ArbiterError))
    return b"".join(data for data, _ in written), len(written), tokens


async def respond(request: web.Request, state: State) -> web.StreamResponse:
    """One decision per line in, one result or error per line out."""
    s = state.settings
    if request.content_length is not None and request.content_length > s.max_jsonl_mb * MB:
        raise PayloadTooLarge(f"the body is over {s.max_jsonl_mb:g} MB (ARBITER_MAX_JSONL_MB)")
    engine = state.holder.require()
    lines = LinesResponse(request, engine, state.admission, state.metrics, s, request[REQUEST_LOG])
    return await lines.run()


class LinesResponse:
    """One JSON Lines request's stream: reads chunks, scores each under its own slot."""

    def __init__(
        self,
        request: web.Request,
        engine: Engine,
        admission: Admission,
        metrics: Metrics,
        settings: ServerSettings,
        info: RequestLog,
    ) -> None:
        self.request = request
        self.engine = engine
        self.admission = admission
        self.metrics = metrics
        self.settings = settings
        self.info = info  # the request log: decisions and tokens are added up here
        max_line = int(settings.max_body_mb * MB)
        self.reader = LineReader(
            max_line,
            lambda: PayloadTooLarge(f"the line is over {max_line / MB:g} MB (ARBITER_MAX_BODY_MB)"),
        )
        self.response = web.StreamResponse(headers={"Content-Type": "application/jsonlines"})
        # A stop is the record of the line after the last one read.
        self.stream = OpenStream(self.response, lambda e: error_record(self.reader.number + 1, e))
        request[OPEN_STREAM] = self.stream

    async def run(self) -> web.StreamResponse:
        s = self.settings
        max_line = int(s.max_body_mb * MB)
        batch: Batch = []
        size = 0
        try:
            body = body_pieces(
                self.request.content, int(s.max_jsonl_mb * MB), s.body_read_timeout_s
            )
            async for number, line in self.reader.alines(body):
                batch.append((number, line))
                size += len(line) if isinstance(line, bytes) else 0
                if len(batch) >= s.jsonl_chunk or size >= max_line:
                    await self._flush(batch)
                    batch, size = [], 0
        except (PayloadTooLarge, RequestTimeout) as exc:
            # Every line read so far is answered first; then the reason the stream stops.
            if batch:
                await self._flush(batch)
            if not self.response.prepared:
                raise
            await self.stream.fail(exc)
            return self.response
        if batch:
            await self._flush(batch)
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.stream.finish()
        return self.response

    async def _flush(self, batch: Batch) -> None:
        # The first chunk is admitted like any request (a 503 before anything is sent); later
        # chunks wait their turn, and lines that cannot get a slot in time say so one by one.
        started = self.response.prepared
        try:
            async with self.admission.slot(admitted=started) as slot:
                # Each line is bounded by the context; the chunk stops if its client goes away.
                engine = Cancellable(self.engine, Budget(cancel=slot.cancel))
                body, count, tokens = await slot.run(score_chunk, engine, self.metrics, batch)
        except ServerBusy as exc:
            if not started:
                raise
            body = b"".join(error_record(n, exc) for n, _ in batch)
            count, tokens = len(batch), 0
        except Exception:
            if not started:
                raise
            # A fault outside the chunk's scoring, once lines were sent: the chunk's lines say
            # so one by one (they were read), then the error middleware ends the stream with
            # the record for the next line (``adapter.streaming``).
            failure = ArbiterError("internal error while this chunk was scored; see the log")
            await self.response.write(b"".join(error_record(n, failure) for n, _ in batch))
            raise
        self.info.decisions += count
        self.info.tokens += tokens
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.response.write(body)
