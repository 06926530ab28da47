"""`lru.get_or_insert`, the shell's lookup verb: the same table as `get_or_create`, and on an insertion the
very session the LRU evicted (what the shell's miss detaches without looking for it)."""

from __future__ import annotations

import random

import functional_state as fs
from functional_state import table as ms
from functional_state.shell.admission import admit
from functional_state.shell.cells import Departure, evicted_reason
from functional_state.table.lru import get_or_insert


def test_get_or_insert_is_get_or_create_and_names_what_it_evicted():
    rng = random.Random(3)
    state = fs.ManagerState.create(max_sessions=5)
    for step in range(300):
        sid = f"s{rng.randrange(9)}"
        before_ids, before_issued = state.session_ids, state.issued
        expected, _ = fs.get_or_create(state, sid)
        after, uid, evicted = get_or_insert(state, sid)
        assert after.session_ids == expected.session_ids and after.counters == expected.counters
        assert uid == ms.incarnation(after, sid)
        if sid in before_ids:
            assert evicted is None
        else:
            assert uid == before_issued
            gone = [s for s in before_ids if s not in after]
            assert [e[0] for e in evicted] == gone == ([before_ids[0]] if len(before_ids) == 5 else [])
            for e_sid, e_uid, e_session in evicted:
                assert e_uid == ms.incarnation(state, e_sid) and e_session is ms.lookup(state, e_sid)
            # the shell's miss path (install ``after``, detach what ``evicted`` names, with `evicted_reason`)
            # decides exactly what the full admission decides
            full = admit(state, after, sid, levers=(), surplus=None, budget=False)
            why = evicted_reason(state.max_sessions)
            assert full.final is after and full.surplus is None and full.released == {}
            assert full.left == [Departure(e_sid, e_uid, e_session, why, False) for e_sid, e_uid, e_session in evicted]
        state = after if step % 7 else expected  # both tables go on the same way
