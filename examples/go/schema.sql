-- The example's tables; `orders setup` runs this file (embedded in the binary). Rerunnable.

-- The order service's own table. version counts the events emitted for the order so far:
-- every event carries its number, so a reader can see that an order's events came in order.
CREATE TABLE IF NOT EXISTS orders (
    id          text        PRIMARY KEY,
    customer    text        NOT NULL,
    status      text        NOT NULL,
    total_cents bigint      NOT NULL,
    version     int         NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- The consumer's read model, built from the events it reads from Kafka. In a real system it
-- lives in the consuming service's own database (which needs outbox_ext too, for
-- inbox.claim); here it shares the database to keep the example to one connection string.
-- Its updates add (events + 1, total_cents + price): applied twice, an event would count
-- twice. inbox.claim is what makes each apply once.
CREATE TABLE IF NOT EXISTS order_views (
    order_id    text   PRIMARY KEY,
    customer    text   NOT NULL,
    status      text   NOT NULL,
    lines       int    NOT NULL,
    total_cents bigint NOT NULL,
    version     int    NOT NULL,  -- the number of the last event applied
    events      int    NOT NULL   -- how many events were applied
);
