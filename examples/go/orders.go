package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"
)

// The order service. Each change of an order writes the order row and emits its events in
// the same transaction: both commit or neither does, so no event is ever lost or sent for an
// order that was rolled back, and nothing has to be published while the transaction is open.

type Line struct {
	SKU        string `json:"sku"`
	Qty        int    `json:"qty"`
	PriceCents int64  `json:"price_cents"`
}

type Order struct {
	ID       string
	Customer string
	Lines    []Line
}

// OrderEvent is the payload of every event of an order. Version numbers an order's events
// 1, 2, 3, ... in the order they were emitted.
type OrderEvent struct {
	OrderID  string `json:"order_id"`
	Version  int    `json:"version"`
	Customer string `json:"customer,omitempty"` // order.created
	*Line           // order.line_added
}

// CreateOrder writes the order and its events in one transaction: order.created, then one
// order.line_added per line.
func CreateOrder(ctx context.Context, db *pgxpool.Pool, o Order) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var total int64
		for _, l := range o.Lines {
			total += int64(l.Qty) * l.PriceCents
		}
		version := 1 + len(o.Lines)
		if _, err := tx.Exec(ctx,
			"INSERT INTO orders (id, customer, status, total_cents, version) VALUES ($1, $2, 'created', $3, $4)",
			o.ID, o.Customer, total, version); err != nil {
			return err
		}
		if err := emit(ctx, tx, "order.created", OrderEvent{OrderID: o.ID, Version: 1, Customer: o.Customer}); err != nil {
			return err
		}
		for i := range o.Lines {
			if err := emit(ctx, tx, "order.line_added", OrderEvent{OrderID: o.ID, Version: 2 + i, Line: &o.Lines[i]}); err != nil {
				return err
			}
		}
		return nil
	}) // BeginFunc commits if the function returns nil, else rolls back: the order and its events with it
}

// PayOrder and ShipOrder move an order on, with an event each.
func PayOrder(ctx context.Context, db *pgxpool.Pool, id string) error {
	return changeStatus(ctx, db, id, "created", "paid")
}

func ShipOrder(ctx context.Context, db *pgxpool.Pool, id string) error {
	return changeStatus(ctx, db, id, "paid", "shipped")
}

func changeStatus(ctx context.Context, db *pgxpool.Pool, id, from, to string) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		// The UPDATE locks the order's row until commit: two changes of one order commit one
		// after the other, so the order's events commit in version order, and outbox_ext
		// hands out one key's events (aggregate_id = the order id) in commit order.
		var version int
		err := tx.QueryRow(ctx,
			"UPDATE orders SET status = $3, version = version + 1 WHERE id = $1 AND status = $2 RETURNING version",
			id, from, to).Scan(&version)
		if err == pgx.ErrNoRows {
			return fmt.Errorf("order %s is not %s", id, from)
		} else if err != nil {
			return err
		}
		return emit(ctx, tx, "order."+to, OrderEvent{OrderID: id, Version: version})
	})
}

// emit writes one event in the caller's transaction. The aggregate id (the order id) is the
// event's key: outbox_ext keeps one key's events in commit order, and the relay makes it the
// Kafka record key, so they stay in order in one partition.
func emit(ctx context.Context, tx pgx.Tx, eventType string, ev OrderEvent) error {
	payload, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	_, err = tx.Exec(ctx, "SELECT outbox.emit('order', $1, $2, $3)", ev.OrderID, eventType, payload)
	return err
}

// createOrders places n orders, `workers` at a time; each goes through created (with one to
// three lines), paid and shipped, a transaction each.
func createOrders(ctx context.Context, n, workers int, prefix string) error {
	db, err := connect(ctx, workers)
	if err != nil {
		return err
	}
	defer db.Close()
	if prefix == "" {
		b := make([]byte, 4)
		rand.Read(b)
		prefix = "order-" + hex.EncodeToString(b)
	}
	var events atomic.Int64
	g, ctx := errgroup.WithContext(ctx) // the first error stops the rest
	g.SetLimit(workers)
	for i := 1; i <= n; i++ {
		g.Go(func() error {
			o := Order{ID: fmt.Sprintf("%s-%d", prefix, i), Customer: fmt.Sprintf("customer-%d", i%7)}
			for l := range 1 + i%3 {
				o.Lines = append(o.Lines, Line{SKU: fmt.Sprintf("sku-%d", (i+l)%11), Qty: 1 + l, PriceCents: int64(100 * (1 + i%5))})
			}
			if err := CreateOrder(ctx, db, o); err != nil {
				return err
			}
			if err := PayOrder(ctx, db, o.ID); err != nil {
				return err
			}
			if err := ShipOrder(ctx, db, o.ID); err != nil {
				return err
			}
			events.Add(int64(len(o.Lines)) + 3)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	log.Printf("placed %d orders (%s-1 to %s-%d): %d events", n, prefix, prefix, n, events.Load())
	return nil
}
