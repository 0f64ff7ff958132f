package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"golang.org/x/sync/errgroup"
)

// The relay: it moves events from the outbox to Kafka, at least once and in order per key.
//
//	batch := claim                        one shard's next events, in commit order, leased to us
//	loop:
//	    publish the batch to Kafka, and wait until the brokers have it
//	    batch := settle_and_claim(failures)   the shard moves past what was published,
//	                                          and we get the next batch in the same call
//
// Settling only after Kafka acknowledged is what makes it at least once: a relay that dies
// between the two leaves its batch to be claimed again once the lease runs out, and those
// events go to Kafka twice (the consumer's inbox.claim drops the second copy). Several relays,
// in one process or many, share the work: each claim takes a shard no one else holds.

const (
	defaultLease = 30 * time.Second
	// Kafka gets this long for a batch, well inside the lease: once the lease has run out,
	// another relay may claim the batch, and then our settle is refused (55000).
	deliveryTimeout = 10 * time.Second
	idlePoll        = 200 * time.Millisecond // an empty claim writes nothing: polling is cheap
)

type relayConfig struct {
	topic     string
	relays    int
	batch     int
	lease     time.Duration
	untilIdle bool
}

// event is a claimed row (outbox.claimed); the relay reads the columns it needs.
type event struct {
	Shard       int32
	Epoch       int64
	ID          [16]byte // uuid; its text form is the message id consumers deduplicate on
	Topic       *string  // emit's topic argument, if the event has one
	AggregateID string
	EventType   string
	Payload     []byte // jsonb as its JSON text; nil for a NULL payload (a tombstone)
	Headers     []byte // jsonb: an object of strings, or nil
}

const claimed = "shard, epoch, id, topic, aggregate_id, event_type, payload, headers"

// failure is one element of settle's failures array: an event that did not reach Kafka.
type failure struct {
	ID        string `json:"id"`
	Error     string `json:"error"`
	Attempted *bool  `json:"attempted,omitempty"` // false: Kafka never judged the record, count no attempt
}

type relay struct {
	relayConfig
	db    *pgxpool.Pool
	kafka *kgo.Client
}

func runRelay(ctx context.Context, cfg relayConfig) error {
	db, err := connect(ctx, cfg.relays)
	if err != nil {
		return err
	}
	defer db.Close()
	kafka, err := kafkaClient(
		// acks=all (franz-go's default, set here to say so): a record counts once every
		// in-sync replica has it, so an event settled after its ack is not lost with a broker.
		// Writes are idempotent (the default too): a produce retried after a lost reply is
		// written neither twice nor out of order.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		// A record failed after this long fails every later record of its partition too
		// (franz-go keeps a partition gapless): what reached Kafka of a key is always a
		// prefix of its events in the batch, and settle sends the rest again, in order.
		kgo.RecordDeliveryTimeout(deliveryTimeout),
		// Records are keyed by order id: franz-go's default partitioner hashes keys as the
		// Java client does (murmur2), so an order's events share one partition, in order.
	)
	if err != nil {
		return err
	}
	defer kafka.Close()
	r := &relay{relayConfig: cfg, db: db, kafka: kafka}

	g, ctx := errgroup.WithContext(ctx) // one loop's error stops them all
	for i := range cfg.relays {
		owner := fmt.Sprintf("orders-relay-%d-%d", os.Getpid(), i) // shown in outbox errors and logs
		log.Printf("%s: relaying outbox consumer %s to Kafka", owner, outboxConsumer)
		g.Go(func() error { return r.loop(ctx, owner) })
	}
	return g.Wait()
}

// loop relays until ctx ends (or, with untilIdle, until a claim finds nothing to do). An error
// of the database or the program ends it; Kafka's errors do not, they go to settle.
func (r *relay) loop(ctx context.Context, owner string) error {
	// A batch in hand is finished (published and settled, or released) even once ctx ends.
	work := context.WithoutCancel(ctx)
	batch, err := r.claim(work, owner)
	for {
		if err != nil {
			return err
		}
		if len(batch) == 0 {
			if r.untilIdle {
				return nil
			}
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(idlePoll):
			}
			batch, err = r.claim(work, owner)
			continue
		}
		if ctx.Err() != nil {
			// Stopping: give the batch back now, rather than leave it leased until the lease runs out.
			_, err := r.db.Exec(work, "SELECT outbox.release($1, $2, $3)", outboxConsumer, batch[0].Shard, batch[0].Epoch)
			return err
		}
		failures := r.publish(work, batch)
		if len(failures) > 0 {
			log.Printf("%s: %d keys of a batch of %d events not published (%s)", owner, len(failures), len(batch), failures[0].Error)
		}
		batch, err = r.settleAndClaim(work, owner, batch[0].Shard, batch[0].Epoch, failures)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55000" {
			// The lease ran out and another relay claimed the shard: the batch is its now,
			// and what we published of it reaches Kafka twice (the inbox drops the second
			// copy). Nothing was settled; do not retry the settle, claim again. Seen often,
			// it means deliveries take longer than the lease: raise -lease or lower -batch.
			log.Printf("%s: lost the lease: %s", owner, pgErr.Message)
			batch, err = r.claim(work, owner)
		}
	}
}

// claim takes one free shard's next batch. It runs in a transaction of its own (a statement
// outside BEGIN is one), as outbox.claim requires.
func (r *relay) claim(ctx context.Context, owner string) ([]event, error) {
	rows, _ := r.db.Query(ctx, "SELECT "+claimed+" FROM outbox.claim($1, $2, $3, $4)",
		outboxConsumer, r.batch, r.lease, owner)
	return pgx.CollectRows(rows, pgx.RowToStructByPos[event])
}

// settleAndClaim settles the batch of (shard, epoch) and claims the next one, in one round trip
// and one transaction. Every event of the batch not in failures counts as delivered. For a
// failed key, settle also keeps back its later events in the batch, whatever we did with them.
func (r *relay) settleAndClaim(ctx context.Context, owner string, shard int32, epoch int64, failures []failure) ([]event, error) {
	if failures == nil {
		failures = []failure{} // '[]', not 'null'
	}
	list, err := json.Marshal(failures)
	if err != nil {
		return nil, err
	}
	rows, _ := r.db.Query(ctx, "SELECT "+claimed+" FROM outbox.settle_and_claim($1, $2, $3, $4, $5, $6, $7)",
		outboxConsumer, shard, epoch, list, r.batch, r.lease, owner)
	return pgx.CollectRows(rows, pgx.RowToStructByPos[event])
}

// publish sends the batch to Kafka and waits for every record's result. It returns the events
// that did not make it, one per key (the first), as settle wants them.
func (r *relay) publish(ctx context.Context, batch []event) []failure {
	// A record too large for a produce request fails at once, alone, without failing the later
	// records of its partition: the key's later events would reach Kafka ahead of it. So such a
	// record is not produced, nor anything after it of its key (settle holds those back).
	errs := make([]error, len(batch))
	tooLarge := map[string]bool{}
	var records []*kgo.Record
	index := make(map[*kgo.Record]int, len(batch))
	for i, ev := range batch {
		if tooLarge[ev.AggregateID] {
			continue
		}
		topic := r.topic
		if ev.Topic != nil {
			topic = *ev.Topic
		}
		rec := &kgo.Record{Topic: topic, Key: []byte(ev.AggregateID), Value: ev.Payload, Headers: headers(ev)}
		if recordBytes(rec) > maxRecordBytes {
			tooLarge[ev.AggregateID] = true
			errs[i] = fmt.Errorf("%d bytes, over %d: %w", recordBytes(rec), maxRecordBytes, kerr.MessageTooLarge)
			continue
		}
		records = append(records, rec)
		index[rec] = i
	}
	// One call for the whole batch: franz-go batches the records per partition and keeps their
	// order within each, and the results come back when all are acknowledged or failed.
	for _, res := range r.kafka.ProduceSync(ctx, records...) { // results come in no particular order
		errs[index[res.Record]] = res.Err
	}
	var failures []failure
	failed := map[string]bool{}
	for i, ev := range batch {
		if errs[i] == nil || failed[ev.AggregateID] {
			continue // settle holds a failed key's later events back by itself
		}
		failed[ev.AggregateID] = true
		f := failure{ID: uuidText(ev.ID), Error: errs[i].Error()}
		if !recordError(errs[i]) {
			// The brokers' trouble, not the event's (no topic, no leader, too slow, not
			// allowed): the key waits, in order, and no attempt is counted against the event,
			// so it is never dead-lettered for it. (A relay whose sink is down as a whole may
			// outbox.release the batch instead, and try again later.)
			f.Attempted = new(false)
		}
		// Else Kafka refused the record itself, or its batch: an attempt is counted. A failed
		// key's first event is retried alone, so one refused only for its batch's sake goes
		// through then; one refused every time is dead-lettered after the consumer's
		// max_attempts, and its key goes on.
		failures = append(failures, f)
	}
	return failures
}

// maxRecordBytes: the most a record may take, below franz-go's default ProducerBatchMaxBytes
// (1,000,012) less a batch's overhead. outbox.emit takes payloads up to
// outbox_ext.max_payload_bytes (1 MiB by default), which can be more.
const maxRecordBytes = 1_000_012 - 512

// recordBytes is about what a record takes in a produce request.
func recordBytes(rec *kgo.Record) int {
	n := len(rec.Key) + len(rec.Value) + 64
	for _, h := range rec.Headers {
		n += len(h.Key) + len(h.Value) + 8
	}
	return n
}

// recordError tells whether Kafka refused the record (or the batch it was in) for its content.
func recordError(err error) bool {
	for _, e := range []error{kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidRecord, kerr.CorruptMessage} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// headers are the event's own headers, then outbox-id (the id consumers deduplicate on) and
// outbox-event-type, like the records of outbox_ext's own Kafka sink.
func headers(ev event) []kgo.RecordHeader {
	var own map[string]string
	_ = json.Unmarshal(ev.Headers, &own) // emit checked it is an object of strings (or NULL)
	names := make([]string, 0, len(own))
	for name := range own {
		names = append(names, name)
	}
	sort.Strings(names)
	var hs []kgo.RecordHeader
	for _, name := range names {
		hs = append(hs, kgo.RecordHeader{Key: name, Value: []byte(own[name])})
	}
	return append(hs,
		kgo.RecordHeader{Key: "outbox-id", Value: []byte(uuidText(ev.ID))},
		kgo.RecordHeader{Key: "outbox-event-type", Value: []byte(ev.EventType)})
}

func uuidText(u [16]byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}
