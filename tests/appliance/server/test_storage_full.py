"""A full database while serving: SQLite itself refuses to grow the file (`max_page_count`
pinned at its size: SQLITE_FULL, as a full disk answers). Writes the admin asks for get a
503 `storage_unavailable`; streams go on (usage rows wait in memory); once the database can
grow again, the waiting rows are written and nothing is lost."""

from __future__ import annotations

import pytest
from server_harness import assert_openai_error, start_harness
from sqlalchemy import event, func, select

from appliance.db.models import UsageRecord

pytestmark = pytest.mark.anyio
ROWS = 4000
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}


@pytest.fixture
async def harness(tmp_path, tiny_gguf):
    h = await start_harness(tmp_path, [str(tiny_gguf)], sessions=2, context=256)
    yield h
    await h.close()


def pin_size(engine) -> callable:
    """Every new connection may not grow the file; the pool's old ones are dropped.
    Returns the undo."""
    def on_connect(dbapi_connection, record) -> None:
        pages = dbapi_connection.execute("PRAGMA page_count").fetchone()[0]
        dbapi_connection.execute(f"PRAGMA max_page_count = {pages}")

    event.listen(engine, "connect", on_connect)
    engine.dispose()

    def undo() -> None:
        event.remove(engine, "connect", on_connect)
        engine.dispose()
    return undo


def usage_rows(db) -> int:
    with db.session() as session:
        return session.execute(select(func.count()).select_from(UsageRecord)).scalar_one()


async def test_full_database_is_a_503_streams_go_on_and_usage_waits(harness):
    db, usage = harness.state.db, harness.state.limiter
    key, _ = await harness.create_key("u", "ursula")
    before = usage_rows(db)
    undo = pin_size(db.engine)
    try:
        filler = {"name": "x" * 120, "user": "y" * 120, "role": "user"}
        for _ in range(64):  # until the pinned pages are used up
            resp = await harness.http.post("/admin/api/keys", json=filler,
                                           headers=harness.auth())
            if resp.status_code != 201:
                break
        err = assert_openai_error(resp, 503, "storage_unavailable")
        assert "storage" in err["message"] and "mbufo.db" not in err["message"]
        assert int(resp.headers["Retry-After"]) >= 1
        for _ in range(3):  # inference does not need the disk
            chat = await harness.http.post("/v1/chat/completions", json=CHAT,
                                           headers=harness.auth(key))
            assert chat.status_code == 200, chat.text
        principal = harness.state.keys.authenticate(f"Bearer {key}")
        for _ in range(ROWS):  # more usage than the file's free room
            usage.record(principal, "tiny", 7, 5, 0, "ok")
        assert not usage.flush()  # refused: the rows are kept for the next try
        assert (await harness.http.get("/health")).status_code == 200
    finally:
        undo()
    assert usage.flush()
    assert usage_rows(db) == before + 3 + ROWS
