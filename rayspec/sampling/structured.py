"""Structured output: a JSON schema, a regex, a Lark grammar or a list of choices constrains the
target's tokens, through llguidance's token-level grammar matcher.

Lossless with speculation the same way penalties are (rayspec.sampling.logits_processing): every
verification row is masked with the grammar state after the tokens before it on its own path
(the drafts before it in a chain, its ancestors in a tree), found by consuming those drafts and
rolling them back. A row behind a draft the grammar rejects is never used (that draft cannot be
accepted: its target probability is zero), so it is left unmasked. The request finishes as soon as
the grammar is complete (nothing but EOS could follow).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass


logger = logging.getLogger("rayspec")

KINDS = ("json", "regex", "grammar", "choice")
# JSON comes out laid out like Python's json.dumps: ", " and ": " and no other whitespace. With
# free whitespace a small model can emit blanks until max_tokens (a known failure mode of
# constrained decoding). A schema can override it: "x-guidance": {"whitespace_flexible": true}.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

# Compiling a grammar (the matcher and its first mask, where the lexer is built) is bounded three ways:
# - llguidance's own limits (LLParserLimits), pinned here to its 1.9 defaults so that an upgrade does not
#   move them, with verbose errors off (they dump parser state and grammar into the message a client gets);
#   the per-step ones (step_lexer_fuel, step_max_items) also bound every later mask, on the engine's thread;
# - a deadline: a grammar not compiled within COMPILE_TIMEOUT_S is refused (ValueError -> a 400), and the
#   caller goes on; the abandoned compile runs out on its own thread, within the limits above, and at
#   most MAX_COMPILES compiles run at once (abandoned ones included): past that a new grammar is
#   refused as busy (GrammarCompilerBusy, a 429), so slow grammars sent over and over cannot pile up
#   threads and CPU;
# - a large stack for that thread: llguidance builds a grammar recursively, one frame per level of rule
#   nesting (~3 KiB each), and a chain of a few thousand rules ("a0: a1 "x"  a1: a2 "x" ...", ~50,000
#   characters) overflows a default 8 MiB thread stack, which kills the whole process (a segfault).
#   256 MiB (address space; only the pages touched are used) holds ~80,000 levels, more than a grammar of
#   the serving layer's size limit (deployments.frontend.openai_limits.LIMITS) can nest.
PARSER_LIMITS = dict(max_items_in_row=2_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                     step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
                     verbose_errors=False)
COMPILE_TIMEOUT_S = 5.0  # measured here: ~0.2 s for 5,000 choices; up to ~1 s for a schema with many patterns
COMPILE_STACK_BYTES = 256 << 20
MAX_COMPILES = 4  # per compiler (a verifier replica), running or abandoned
CACHE_SIZE = 64  # compiled grammars kept per compiler (GrammarCompiler), least recently used dropped first


class GrammarCompilerBusy(RuntimeError):
    """MAX_COMPILES grammars are compiling (or abandoned past their deadline and still running)."""
_thread_start_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # json (a JSON schema), regex, grammar (Lark), choice
    value: str  # the schema as JSON text, the regex, the grammar, or the choices as a JSON list

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}")

    @staticmethod
    def json_schema(schema: dict | str) -> "StructuredOutput":
        return StructuredOutput("json", schema if isinstance(schema, str) else json.dumps(schema))

    @staticmethod
    def choice(choices: list[str]) -> "StructuredOutput":
        return StructuredOutput("choice", json.dumps(list(choices)))

    def grammar_text(self) -> str:
        """The llguidance grammar; ValueError when the value is not what its kind needs."""
        from llguidance import LLMatcher

        if self.kind == "json":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
            except RecursionError:  # (a string of a thousand "[": Python's parser gives up before JSON's)
                raise ValueError("the JSON schema is nested too deeply") from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.value)
        try:
            choices = json.loads(self.value)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError("choices must be a JSON list of strings") from None
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        # Lark string literals use JSON's escapes
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


class GrammarCompiler:
    """Per engine: the tokenizer in llguidance's form (built once, on first use: ~0.25 s here).
    Thread-safe, so a server can build grammars off the engine's thread. Each grammar is compiled on
    a thread of its own (a large stack) with a deadline: `compile_timeout_s` (None: no deadline).

    Compiled grammars are kept (the last `cache_size`, by their grammar text) and every request gets
    a copy of its own: a request with n=8 choices, or eight clients sending one schema, compile it
    once. A grammar asked for while it compiles waits for that compile (within its own deadline)
    rather than starting another: identical requests arriving together (an n>1 request fans out
    one per choice) take one of the MAX_COMPILES places, not one each."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int],
                 compile_timeout_s: float | None = COMPILE_TIMEOUT_S, cache_size: int = CACHE_SIZE):
        self._hf_tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self._tokenizer = None
        self._lock = threading.Lock()
        self._running = threading.BoundedSemaphore(MAX_COMPILES)  # compile threads alive
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()  # (kind, grammar) -> matcher
        self._compiling: dict[tuple[str, str], tuple[threading.Event, dict]] = {}
        self.num_compiled = self.num_reused = 0  # compiles ended; grammars served from the kept ones

    def state(self, spec: StructuredOutput) -> "GrammarState":
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise ValueError("structured output needs llguidance (pip install llguidance)") from None
        if self._hf_tokenizer is None:
            raise ValueError("structured output needs a tokenizer")
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self._eos or None)
        grammar = spec.grammar_text()  # cheap (no compiling); ValueError for a malformed value
        key = (spec.kind, grammar)
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                self.num_reused += 1
                return GrammarState(template.deep_copy(), self.vocab_size)
            flight = self._compiling.get(key)
            if flight is None:
                if not self._running.acquire(blocking=False):
                    raise GrammarCompilerBusy(f"{MAX_COMPILES} output constraints are compiling on this replica")
                flight = self._compiling[key] = (threading.Event(), {})
                try:
                    _start_compile_thread(lambda: self._compile_into(key, flight))
                except BaseException:
                    del self._compiling[key]
                    self._running.release()
                    raise
        done, box = flight
        if not done.wait(self.compile_timeout_s):
            raise ValueError(f"the {spec.kind} output constraint took longer than {self.compile_timeout_s:g} s "
                             "to compile; simplify it")
        if "error" in box:
            raise box["error"]
        with self._lock:  # (the compiled matcher is only ever copied, never advanced)
            return GrammarState(box["matcher"].deep_copy(), self.vocab_size)

    def _compile_into(self, key: tuple[str, str], flight: tuple[threading.Event, dict]) -> None:
        """On the compile thread: the grammar compiled into the flight's box (and kept), or its error."""
        done, box = flight
        try:
            box["matcher"] = _compile(self._tokenizer, key[1], key[0])
        except BaseException as err:  # noqa: BLE001 - handed to the waiting callers
            box["error"] = err
        finally:
            with self._lock:
                del self._compiling[key]
                if "matcher" in box and self.cache_size > 0:
                    self._compiled[key] = box["matcher"]
                    while len(self._compiled) > self.cache_size:
                        self._compiled.popitem(last=False)
                self.num_compiled += 1
            self._running.release()
            done.set()


def _compile(tokenizer, grammar: str, kind: str):
    import llguidance

    limits = llguidance.LLParserLimits(**PARSER_LIMITS)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise ValueError(f"invalid {kind} for structured output: {matcher.get_error()}")
    # the first mask builds the grammar's lexer: up to ~1 s for a schema with many patterns and
    # numbers (measured; later matchers of the same schema take 0.1 ms). Pay it here, where a
    # server can do it off the engine's thread, not inside a step that every request waits on.
    matcher.compute_bitmask()
    if matcher.is_error():
        raise ValueError(f"invalid {kind} for structured output: {matcher.get_error()}")
    return matcher


def _start_compile_thread(target) -> None:
    with _thread_start_lock:
        try:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform that cannot set it: the default stack
            previous = None
        try:
            threading.Thread(target=target, name="rayspec-grammar-compile", daemon=True).start()
        finally:
            if previous is not None:
                threading.stack_size(previous)


def _parents_first(tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """Reorder a tree so every node comes after its parent (added chains can hang below nodes that
    were appended later)."""
    order, seen = [], set()

    def visit(j: int) -> None:
        if j in seen:
            return
        if parents[j] >= 0:
            visit(parents[j])
        seen.add(j)
        order.append(j)

    for j in range(len(tokens)):
        visit(j)
    index = {old: new for new, old in enumerate(order)}
    return [tokens[j] for j in order], [index[parents[j]] if parents[j] >= 0 else -1 for j in order]


class GrammarState:
    """One request's grammar matcher, advanced by every committed token."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self._words = (vocab_size + 31) // 32
        import torch

        self._shifts = torch.arange(32, dtype=torch.int32)

    def accept(self, token: int) -> bool:
        ok = self.matcher.consume_token(token)
        if not ok:
            logger.warning("grammar rejected committed token %d: %s", token, self.matcher.get_error())
        return ok

    @property
    def done(self) -> bool:
        """Complete: only EOS could follow (or the matcher failed)."""
        return self.matcher.is_stopped()

    def fix_draft(self, proposed: list[int], budget: int) -> list[int]:
        """Up to `budget` draft tokens after the committed ones: at each position the tokens the
        grammar forces (fast-forward), else the proposer's next token while the draft so far is still
        the proposer's and the grammar allows it; it ends at the first position with neither."""
        tokens: list[int] = []
        consumed = 0
        try:
            while len(tokens) < budget:
                forced = self.matcher.compute_ff_tokens()[: budget - len(tokens)]
                if forced:
                    taken = self.matcher.try_consume_tokens(forced)
                    consumed += taken
                    tokens += forced[:taken]
                    if taken < len(forced):
                        break
                    continue
                aligned = tokens == proposed[: len(tokens)] and len(tokens) < len(proposed)
                if not aligned or self.matcher.try_consume_tokens([proposed[len(tokens)]]) != 1:
                    break
                consumed += 1
                tokens.append(proposed[len(tokens)])
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return tokens

    def fix_tree(self, tokens: list[int], parents: list[int], budget: int) -> tuple[list[int], list[int]]:
        """A token tree (parents before children) made to follow the grammar: nodes whose path the
        grammar forbids are dropped with their subtrees, and below the root and each kept node the
        tokens the grammar forces there are hung as a chain (reusing a kept child that already has
        the forced token), while the tree has fewer than `budget` nodes."""
        children: dict[int, list[int]] = {}
        for j, p in enumerate(parents):
            children.setdefault(p, []).append(j)
        out_tokens: list[int] = []
        out_parents: list[int] = []

        def path_of(node: int) -> list[int]:
            path = []
            while node >= 0:
                path.append(out_tokens[node])
                node = out_parents[node]
            return path[::-1]

        # (old node or None for an added one, new index or -1 for the root), in parents-first order
        queue: list[tuple[int, int]] = [(-1, -1)]
        while queue:
            old, new = queue.pop(0)
            path = path_of(new)
            consumed = self.matcher.try_consume_tokens(path) if path else 0
            try:
                if consumed < len(path):
                    continue  # cannot happen for kept nodes; defensive
                kept_children = {}
                for child in children.get(old, []) if old is not None else []:
                    if self.matcher.validate_tokens([tokens[child]]) == 1:
                        out_tokens.append(tokens[child])
                        out_parents.append(new)
                        kept_children[tokens[child]] = len(out_tokens) - 1
                        queue.append((child, len(out_tokens) - 1))
                forced = self.matcher.compute_ff_tokens()
            finally:
                if consumed:
                    self.matcher.rollback(consumed)
            if forced and forced[0] in kept_children:
                continue  # that child is queued: the rest of the forced run goes below it then
            at = new
            for tok in forced:
                if len(out_tokens) >= budget:
                    break
                out_tokens.append(tok)
                out_parents.append(at)
                at = len(out_tokens) - 1
        # kept nodes can exceed the budget only if the proposer's tree did; order stays parents-first
        return _parents_first(out_tokens, out_parents)

    def allowed_rows(self, row_extra: list[list[int]], device) -> torch.Tensor:
        """For rows that come after the committed tokens plus row_extra[r]: bool [R, vocab], the
        tokens the grammar allows there (everything for a row behind a rejected draft)."""
        import llguidance.torch
        import torch

        bitmask = torch.full((len(row_extra), self._words), -1, dtype=torch.int32)  # [R, words], -1: all allowed
        for r, extra in enumerate(row_extra):
            consumed = self.matcher.try_consume_tokens(extra) if extra else 0
            if consumed == len(extra):
                llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, r)
            if consumed:
                self.matcher.rollback(consumed)
        bits = (bitmask[:, :, None] >> self._shifts) & 1  # [R, words, 32]
        return bits.view(len(row_extra), -1)[:, : self.vocab_size].bool().to(device)
