"""Fair share of session slots across clients.

Round-robin admission only helps when a slot frees up; a client that arrived first can
still hold every slot while another client's request waits for one of its streams to
end. When all slots are taken and a client with no resident sequence is waiting, the
client holding the most slots above its share (max_sessions / clients with work) gives
one up: its lowest-ranked resident is preempted (its whole pages go to the prefix cache,
so the recompute is mostly a cache hit) and queued again at the front of its own client's
queue, and the waiting client takes the slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

from engine.scheduler.policies.client_rr import ClientRoundRobin
from engine.scheduler.sequence import Sequence


class FairShare:
    name = "fair_share"

    def victim(self, running: Seq[Sequence], queue: ClientRoundRobin,
               max_sessions: int) -> tuple[Sequence, str] | None:
        """(resident to preempt, waiting client that gets the slot), or None."""
        waiting = [client for client, seqs in queue.waiting() if seqs]
        resident = Counter(s.request.client_id for s in running)
        starved = [c for c in waiting if resident[c] == 0]
        if not starved or not resident:
            return None
        share = max(1, max_sessions // len(set(resident) | set(waiting)))
        heavy, count = resident.most_common(1)[0]
        if count <= share:
            return None
        mine = [s for s in running if s.request.client_id == heavy]
        return min(mine, key=lambda s: s.rank), starved[0]
