"""Client round robin: the waiting queue, per client, with admission rotating over clients.

Each client has its own FIFO; admission takes the head of the client whose turn it is and
moves that client to the back of the turn order. A client with 20 queued requests and three
clients with one each: the three are admitted within the first four slots, not after the
twenty. The same turn-taking orders prefills that share a step's budget (`interleave`). A
client may hold at most `max_pending` requests in the queue (ClientQuotaExceeded
at submit, code `client_quota`); `set_limit` overrides it per client (API-key quotas).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable

from engine.errors import ClientQuotaExceeded
from engine.scheduler.sequence import Sequence


class ClientRoundRobin:
    name = "client_rr"

    def __init__(self, max_pending: int | None = None) -> None:
        self.max_pending = max_pending
        self._limits: dict[str, int | None] = {}
        # Turn order: the first key is the next client to admit from.
        self._queues: OrderedDict[str, deque[Sequence]] = OrderedDict()

    def set_limit(self, client_id: str, max_pending: int | None) -> None:
        self._limits[client_id] = max_pending

    def limit(self, client_id: str) -> int | None:
        return self._limits.get(client_id, self.max_pending)

    def num_pending(self, client_id: str) -> int:
        return len(self._queues.get(client_id, ()))

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def push(self, seq: Sequence) -> None:
        """Queue a new request; raises ClientQuotaExceeded when its client is at its limit."""
        client = seq.request.client_id
        limit = self.limit(client)
        pending = self.num_pending(client)
        if limit is not None and pending >= limit:
            raise ClientQuotaExceeded(
                f"client {client!r} has {pending} pending requests (limit {limit})")
        self._queues.setdefault(client, deque()).append(seq)

    def push_front(self, seq: Sequence) -> None:
        """Queue a resident that gave up its slot: first in its client's queue, no quota."""
        self._queues.setdefault(seq.request.client_id, deque()).appendleft(seq)

    def pop_client(self, client_id: str) -> Sequence | None:
        """The next request of one client (its turn in the rotation moves to the back)."""
        queue = self._queues.pop(client_id, None)
        if not queue:
            return None
        seq = queue.popleft()
        if queue:
            self._queues[client_id] = queue
        return seq

    def pop(self) -> Sequence | None:
        """The next request to admit, rotating over clients with waiting requests."""
        if not self._queues:
            return None
        client, queue = next(iter(self._queues.items()))
        seq = queue.popleft()
        del self._queues[client]
        if queue:
            self._queues[client] = queue  # to the back of the turn order
        return seq

    def remove(self, seq: Sequence) -> bool:
        queue = self._queues.get(seq.request.client_id)
        if queue is None or seq not in queue:
            return False
        queue.remove(seq)
        if not queue:
            del self._queues[seq.request.client_id]
        return True

    def waiting(self) -> list[tuple[str, list[Sequence]]]:
        """(client id, its queue) in turn order, for stats."""
        return [(c, list(q)) for c, q in self._queues.items()]


def interleave(seqs: Iterable[Sequence]) -> list[Sequence]:
    """Clients take turns: every client's first sequence, then every client's second, ...,
    clients in the order they first appear, each client's own order kept."""
    turn: Counter[str] = Counter()
    first: dict[str, int] = {}
    keyed = []
    for seq in seqs:
        client = seq.request.client_id
        first.setdefault(client, len(first))
        keyed.append((turn[client], first[client], seq))
        turn[client] += 1
    return [seq for _, _, seq in sorted(keyed, key=lambda k: (k[0], k[1]))]
