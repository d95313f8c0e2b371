"""A real HTTP server on 127.0.0.1 that speaks the OpenAI chat-completions protocol.

The curation tests drive it with the real `openai` client. Answers are scripted by a function of
the request body; faults are injected per request (429 with Retry-After, 5xx, hanging past the
client's timeout, dropping the connection). The server counts every request it *received* and
every response it *answered* (wrote a 200 for), per hash of the request body, so a test can assert
that no paid request was ever answered twice.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import http.server
import json
import threading
import time
from typing import Callable


def body_hash(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


@dataclasses.dataclass
class Fault:
    """What to do instead of answering. kind: "status" (HTTP `status` with `headers`), "hang" (sleep
    `seconds`, then drop the connection without answering), "drop" (close at once)."""
    kind: str = "status"
    status: int = 500
    headers: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


@dataclasses.dataclass
class Reply:
    content: str
    finish_reason: str = "stop"
    extra_message: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Received:
    n: int                 # 1-based arrival number
    t: float               # time.monotonic() at arrival
    hash: str
    body: dict
    outcome: str = ""      # "answered", "status 429", "hang", "drop", "dropped by hook"


class FakeOpenAIServer:
    """`with FakeOpenAIServer(script) as srv: OpenAI(base_url=srv.base_url, ...)`.

    `script(body) -> str | Reply` answers a request. `add_fault(fault, when, times)` makes the next
    `times` requests matching `when(body)` fail with `fault`. `on_receive(record) -> bool` runs for
    every request before anything else; returning True drops it unanswered (used to SIGKILL a
    client mid-run). `api_key`, when set, must be presented as a Bearer token (else 401).
    """

    def __init__(self, script: Callable[[dict], str | Reply], api_key: str | None = None):
        self.script = script
        self.api_key = api_key
        self.on_receive: Callable[[Received], bool] | None = None
        self.received: collections.Counter[str] = collections.Counter()
        self.answered: collections.Counter[str] = collections.Counter()
        self.log: list[Received] = []
        self.tokens_answered = 0
        self._faults: list[list] = []          # [when, fault, remaining]
        self._lock = threading.Lock()
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- control -------------------------------------------------------------------------------
    def add_fault(self, fault: Fault, when: Callable[[dict], bool] = lambda body: True, times: int = 1) -> None:
        with self._lock:
            self._faults.append([when, fault, times])

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def base_url(self) -> str:
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def usage_total(self) -> int:
        """Total tokens of every answered request (what the client was billed)."""
        with self._lock:
            return self.tokens_answered

    def n_received(self) -> int:
        with self._lock:
            return len(self.log)

    def start(self) -> "FakeOpenAIServer":
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                server._handle(self)

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "FakeOpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- protocol ------------------------------------------------------------------------------
    def _send_json(self, h: http.server.BaseHTTPRequestHandler, status: int, payload: dict,
                   headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, str(v))
        h.end_headers()
        h.wfile.write(data)
        h.wfile.flush()

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length)
        if h.path.rstrip("/") != "/v1/chat/completions":
            self._send_json(h, 404, {"error": {"message": f"no route {h.path}", "type": "not_found"}})
            return
        if self.api_key is not None and h.headers.get("Authorization") != f"Bearer {self.api_key}":
            self._send_json(h, 401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                               "code": "invalid_api_key"}})
            return
        body = json.loads(raw)
        key = body_hash(body)
        with self._lock:
            record = Received(n=len(self.log) + 1, t=time.monotonic(), hash=key, body=body)
            self.log.append(record)
            self.received[key] += 1
            fault = None
            for entry in self._faults:
                if entry[2] > 0 and entry[0](body):
                    entry[2] -= 1
                    fault = entry[1]
                    break
        if self.on_receive is not None and self.on_receive(record):
            record.outcome = "dropped by hook"
            h.close_connection = True
            return
        if fault is not None:
            if fault.kind == "status":
                record.outcome = f"status {fault.status}"
                self._send_json(h, fault.status, {"error": {"message": f"injected {fault.status}", "type": "server_error"}},
                                fault.headers)
                return
            if fault.kind == "hang":
                record.outcome = "hang"
                time.sleep(fault.seconds)
            else:
                record.outcome = "drop"
            h.close_connection = True
            return
        reply = self.script(body)
        if isinstance(reply, str):
            reply = Reply(reply)
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        completion_tokens = len(reply.content.split())
        payload = {
            "id": "chatcmpl-" + key[:24], "object": "chat.completion", "created": 1700000000,
            "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": reply.finish_reason, "logprobs": None,
                         "message": {"role": "assistant", "content": reply.content, **reply.extra_message}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }
        try:
            self._send_json(h, 200, payload)
        except (BrokenPipeError, ConnectionResetError):
            record.outcome = "client gone"
            return
        record.outcome = "answered"
        with self._lock:
            self.answered[key] += 1
            self.tokens_answered += prompt_tokens + completion_tokens


# ---- a scripted curation endpoint -------------------------------------------------------------

# Four MATH-style problems, each with the serial trace the "teacher" writes, the steps the
# "extractor" returns and the edges the "DAG model" returns. The [tN] marker in every problem lets
# the script route extractor / DAG requests (their user message repeats the problem) to the task.
CURATION_TASKS: list[dict] = [
    dict(id="t1", problem="[t1] Compute (2+3)*(4+5).", answer="45",
         steps=[("Compute 2+3, the first factor.", "2 + 3 = 5, so the first factor is 5."),
                ("Compute 4+5, the second factor.", "4 + 5 = 9, so the second factor is 9."),
                ("Multiply the two factors.", "5 * 9 = 45, which is the product asked for.")],
         edges=[(1, 3), (2, 3)], final="45"),
    dict(
        id="t2", problem="[t2] Let a = 2. Compute (a+1) + (a+2) + (a+3).", answer="12",
        steps=[("Note the value of a.", "a is given as 2, so every term uses a = 2."),
               ("Evaluate the first term a+1.", "a + 1 = 2 + 1 = 3 for the first term."),
               ("Evaluate the second term a+2.", "a + 2 = 2 + 2 = 4 for the second term."),
               ("Evaluate the third term a+3.", "a + 3 = 2 + 3 = 5 for the third term."),
               ("Add the three terms.", "3 + 4 + 5 = 12, the sum of the three terms.")],
        edges=[(1, 2), (1, 3), (1, 4), (2, 5), (3, 5), (4, 5)], final="12"),
    dict(id="t3", problem="[t3] Start at 1, double it, then double again, then add 1.", answer="5",
         steps=[("Double the starting value.", "1 * 2 = 2 after the first doubling step."),
                ("Double the result again.", "2 * 2 = 4 after the second doubling step."),
                ("Add one to the result.", "4 + 1 = 5 after adding one to the result.")],
         edges=[(1, 2), (2, 3)], final="5"),
    dict(id="t4", problem="[t4] Compute 3+5.", answer="8",
         steps=[("Add the numbers.", "3 + 5 = 7 (an arithmetic slip the filter must catch).")],
         edges=[], final="7"),
]


def trace_text(task: dict) -> str:
    """The teacher's serial trace: every step's plan and work as prose, then the boxed answer."""
    paras = [f"{plan} {execution}" for plan, execution in task["steps"]]
    return "\n\n".join(paras + [f"So the final answer is \\boxed{{{task['final']}}}."])


def write_math_jsonl(path) -> None:
    with open(path, "w") as f:
        for t in CURATION_TASKS:
            f.write(json.dumps({"problem": t["problem"], "answer": t["answer"], "unique_id": t["id"]}) + "\n")


class ScriptedCurator:
    """server.script for the curation pipeline: routes by the request's response_format (none =
    teacher, reasoning_steps = extractor, step_dependencies = DAG) and by the [tN] marker.

    Overrides per task: `teacher[tid]` = trace text, `extract[(tid, turn)]` = raw reply for the
    first (turn 0) or repair (turn 1) extraction request, `edges[tid]` = the DAG reply's edges.
    """

    def __init__(self, tasks: list[dict] = CURATION_TASKS):
        self.tasks = {t["id"]: t for t in tasks}
        self.teacher: dict[str, str | Reply] = {}
        self.extract: dict[tuple[str, int], str] = {}
        self.edges: dict[str, list] = {}

    @staticmethod
    def purpose(body: dict) -> str:
        fmt = body.get("response_format")
        if not fmt:
            return "teacher"
        return {"reasoning_steps": "extract", "step_dependencies": "dag"}[fmt["json_schema"]["name"]]

    @staticmethod
    def task_id(body: dict) -> str:
        import re
        return re.search(r"\[(t\d+)\]", body["messages"][1]["content"]).group(1)

    def __call__(self, body: dict) -> str | Reply:
        purpose, tid = self.purpose(body), self.task_id(body)
        task = self.tasks[tid]
        if purpose == "teacher":
            return self.teacher.get(tid, trace_text(task))
        if purpose == "extract":
            turn = 1 if len(body["messages"]) > 2 else 0
            if (tid, turn) in self.extract:
                return self.extract[(tid, turn)]
            return json.dumps({"steps": [{"plan": p, "execution": e} for p, e in task["steps"]]})
        edges = self.edges.get(tid, task["edges"])
        return json.dumps({"edges": [{"parent": a, "child": b} for a, b in edges]})
