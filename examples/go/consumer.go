package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// The consumer: it reads order events from Kafka and keeps order_views, applying each event
// exactly once. Kafka gives it every event at least once (a relay may publish a batch twice;
// the consumer itself may read a record again after a crash, before its offset was committed).
// So, in one transaction per record:
//
//	BEGIN;
//	SELECT inbox.claim(<outbox-id header>, 'order-views');   -- true the first time only
//	UPDATE order_views ...;                                   -- only if it returned true
//	COMMIT;
//
// The claim and the effect commit together or not at all: a crash between them leaves
// neither, and the record, read again, is applied then. Offsets are committed to Kafka after
// the database commits, so nothing is skipped; the inbox drops what is read twice.

func consume(ctx context.Context, topic, group string, untilCaughtUp bool) error {
	db, err := connect(ctx, 1)
	if err != nil {
		return err
	}
	defer db.Close()
	cl, err := kafkaClient(
		kgo.ConsumeTopics(topic),
		kgo.ConsumerGroup(group),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), // a new group reads the topic from its start
		kgo.DisableAutoCommit(),                           // commit only what the database has
		kgo.BlockRebalanceOnPoll(),                        // and commit it before partitions move
	)
	if err != nil {
		return err
	}
	defer cl.Close()
	defer cl.AllowRebalance() // whatever we return with: else Close waits to leave the group

	adm := kadm.NewClient(cl)
	var ends kadm.ListedOffsets
	if untilCaughtUp {
		if ends, err = adm.ListEndOffsets(ctx, topic); err == nil {
			err = ends.Error()
		}
		if err != nil {
			return err
		}
	}
	var applied, duplicates int
	defer func() { log.Printf("applied %d events, dropped %d duplicates", applied, duplicates) }()
	for {
		if untilCaughtUp {
			if done, err := caughtUp(ctx, adm, group, ends); err != nil || done {
				return err
			}
		}
		// Poll at most a second at a time, so that the check above runs when nothing comes.
		pollCtx, cancel := context.WithTimeout(ctx, time.Second)
		fetches := cl.PollFetches(pollCtx)
		cancel()
		if ctx.Err() != nil {
			return nil // asked to stop: what was polled and not applied is read again next time
		}
		for _, fe := range fetches.Errors() {
			if !errors.Is(fe.Err, context.DeadlineExceeded) {
				return fmt.Errorf("fetching %s[%d]: %w", fe.Topic, fe.Partition, fe.Err)
			}
		}
		for it := fetches.RecordIter(); !it.Done(); {
			rec := it.Next()
			first, err := apply(ctx, db, rec)
			if err != nil && ctx.Err() != nil {
				return nil // asked to stop mid-record: it was rolled back, and is read again next time
			} else if err != nil {
				return fmt.Errorf("%s[%d] at %d: %w", rec.Topic, rec.Partition, rec.Offset, err)
			}
			if first {
				applied++
			} else {
				duplicates++
			}
		}
		if err := cl.CommitUncommittedOffsets(ctx); err != nil {
			return err
		}
		cl.AllowRebalance()
	}
}

// apply makes the record's effect, once per message id. It returns false for a duplicate.
func apply(ctx context.Context, db *pgxpool.Pool, rec *kgo.Record) (first bool, err error) {
	var id, eventType string
	for _, h := range rec.Headers {
		switch h.Key {
		case "outbox-id":
			id = string(h.Value)
		case "outbox-event-type":
			eventType = string(h.Value)
		}
	}
	if id == "" {
		return false, errors.New("no outbox-id header")
	}
	var ev OrderEvent
	if rec.Value != nil { // nil: a tombstone
		if err := json.Unmarshal(rec.Value, &ev); err != nil {
			return false, err
		}
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		// A copy of this message being applied at the same moment (by another member of the
		// group, after a rebalance) waits here until that transaction ends: then false if it
		// committed, true if it rolled back (its effect with it).
		if err := tx.QueryRow(ctx, "SELECT inbox.claim($1, $2)", id, inboxConsumer).Scan(&first); err != nil || !first {
			return err // a duplicate: its effect committed already, with its claim
		}
		var tag pgconn.CommandTag
		var err error
		switch eventType {
		case "order.created":
			tag, err = tx.Exec(ctx, `INSERT INTO order_views (order_id, customer, status, lines, total_cents, version, events)
			                         VALUES ($1, $2, 'created', 0, 0, $3, 1)`, ev.OrderID, ev.Customer, ev.Version)
		case "order.line_added":
			tag, err = tx.Exec(ctx, `UPDATE order_views SET lines = lines + 1, total_cents = total_cents + $3,
			                                version = $2, events = events + 1 WHERE order_id = $1`,
				ev.OrderID, ev.Version, int64(ev.Qty)*ev.PriceCents)
		case "order.paid", "order.shipped":
			tag, err = tx.Exec(ctx, `UPDATE order_views SET status = $3, version = $2, events = events + 1
			                         WHERE order_id = $1`, ev.OrderID, ev.Version, strings.TrimPrefix(eventType, "order."))
		default:
			return nil // not an order event: claimed all the same, so it is skipped once
		}
		if err == nil && tag.RowsAffected() == 0 {
			// No view to update: the order's order.created has not been applied. One order's
			// events come in order (one key, one partition), so this is a bug upstream; stop.
			return fmt.Errorf("%s of order %s came before its order.created", eventType, ev.OrderID)
		}
		return err
	}) // commits if the function returned nil: the claim and the effect together
	return first, err
}

// caughtUp tells whether the group has committed, in every partition, the offset the topic
// ended at when we started.
func caughtUp(ctx context.Context, adm *kadm.Client, group string, ends kadm.ListedOffsets) (bool, error) {
	committed, err := adm.FetchOffsets(ctx, group)
	if kerr.IsRetriable(err) {
		return false, nil // e.g. the group coordinator is not ready yet (the group's first use)
	} else if err != nil {
		return false, err
	}
	done := true
	ends.Each(func(end kadm.ListedOffset) {
		c, ok := committed.Lookup(end.Topic, end.Partition)
		if end.Offset > 0 && (!ok || c.At < end.Offset) {
			done = false
		}
	})
	return done, nil
}
