"""A profile of the served model from inside its process, for `specpipe loadtest --profile DIR`.

With the environment variable SPECPIPE_PROFILE_DIR set, the Triton model records every engine call of its
scheduler (`StepTrace`) and, for each answered request, its answering thread's kernel id, CPU time and the time
spent handing responses to Triton (building the output tensors and `sender.send`), and writes them as
`DIR/served-<pid>.json` when Triton unloads it. Free of Triton imports; times are time.time() seconds.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from specpipe.speculative.batching import BatchScheduler, StepTrace

PROFILE_ENV = "SPECPIPE_PROFILE_DIR"


@dataclass
class AnswerRecord:
    thread_id: int
    start: float
    end: float = 0.0
    cpu_s: float = 0.0  # the answering thread's CPU time (detokenizing, tensors, sends)
    send_s: float = 0.0  # wall time building pb_utils tensors and inside sender.send
    cancel_check_s: float = 0.0  # wall time inside sender.is_cancelled (a round trip to tritonserver)
    cancel_checks: int = 0
    responses: int = 0
    tokens: int = 0


@dataclass
class ServedProfile:
    scheduler: Optional[BatchScheduler]
    answers: list[AnswerRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # time.time() - time.perf_counter(): the trace's perf_counter spans on the wall clock the client sees
    clock_offset: float = field(default_factory=lambda: time.time() - time.perf_counter())

    @classmethod
    def from_env(cls, scheduler) -> Optional["ServedProfile"]:
        if not os.environ.get(PROFILE_ENV):
            return None
        if isinstance(scheduler, BatchScheduler):
            scheduler.trace = StepTrace()
        else:
            scheduler = None
        return cls(scheduler)

    def answer(self) -> AnswerRecord:
        record = AnswerRecord(threading.get_native_id(), time.time())
        with self._lock:
            self.answers.append(record)
        return record

    def write(self) -> Path:
        folder = Path(os.environ[PROFILE_ENV])
        folder.mkdir(parents=True, exist_ok=True)
        trace = self.scheduler.trace if self.scheduler is not None else None
        data = {
            "pid": os.getpid(),
            "scheduler_thread_id": self.scheduler.thread_id if self.scheduler is not None else None,
            "calls": [(kind, rows, tokens, t0 + self.clock_offset, t1 + self.clock_offset)
                      for kind, rows, tokens, t0, t1 in (trace.calls if trace else [])],
            "answers": [asdict(a) for a in self.answers],
        }
        path = folder / f"served-{os.getpid()}.json"
        path.write_text(json.dumps(data))
        return path
