// Command orders is the order service the transactional outbox is usually taught with, on
// outbox_ext, pgx and franz-go, in four parts:
//
//   - the service (orders.go): CreateOrder writes the order row and its events, with
//     outbox.emit, in one transaction, so there is never an order without its events or an
//     event without its order;
//   - a relay (relay.go): claims batches of events with outbox.claim, publishes them to Kafka
//     and settles them with outbox.settle_and_claim;
//   - a consumer (consumer.go): reads the topic and applies each event exactly once, with
//     inbox.claim in the transaction of its effect;
//   - setup (here): the tables, the outbox consumer and the Kafka topic.
//
// Usage: orders setup | create-topic | create-orders | relay | consume [flags]
//
// The database comes from DATABASE_URL (a libpq URL or key=value string; when unset, the
// PGHOST, PGPORT, PGUSER, PGDATABASE and PGPASSWORD variables), the Kafka brokers from
// KAFKA_BROKERS (host:port,host:port; default localhost:9092).
package main

import (
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

//go:embed schema.sql
var schema string

const (
	// outboxConsumer is the relay's name in outbox_ext: its position in the event log (one
	// cursor per shard) is kept under this name, and every relay process started with it
	// shares the work.
	outboxConsumer = "kafka-orders"
	// inboxConsumer is the consumer's name in inbox.claim: the same event id is applied once
	// per name, so two services reading the topic would each use their own.
	inboxConsumer = "order-views"
)

func main() {
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	if len(os.Args) < 2 {
		usage()
	}
	// SIGINT or SIGTERM: the relay and the consumer finish what they hold and exit 0
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	cmd, args := os.Args[1], os.Args[2:]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	topicFlag := func() *string { return fs.String("topic", "orders", "the Kafka topic of order events") }
	var run func() error
	switch cmd {
	case "setup":
		run = func() error { return setup(ctx) }
	case "create-topic":
		topic := topicFlag()
		partitions := fs.Int("partitions", 4, "partitions of the topic")
		run = func() error { return createTopic(ctx, *topic, int32(*partitions)) }
	case "create-orders":
		n := fs.Int("n", 50, "how many orders to place")
		workers := fs.Int("workers", 8, "orders placed at once, each in transactions of its own")
		prefix := fs.String("prefix", "", "order ids are <prefix>-1 ... <prefix>-n (default: a random prefix)")
		run = func() error { return createOrders(ctx, *n, *workers, *prefix) }
	case "relay":
		cfg := relayConfig{}
		topic := topicFlag()
		fs.IntVar(&cfg.relays, "relays", 2, "relay loops in this process (each takes its own shards)")
		fs.IntVar(&cfg.batch, "batch", 100, "events per claim")
		fs.DurationVar(&cfg.lease, "lease", defaultLease, "how long a claimed batch is ours")
		fs.BoolVar(&cfg.untilIdle, "until-idle", false, "exit at the first claim that finds nothing to do")
		run = func() error { cfg.topic = *topic; return runRelay(ctx, cfg) }
	case "consume":
		topic := topicFlag()
		group := fs.String("group", inboxConsumer, "the Kafka consumer group")
		caughtUp := fs.Bool("until-caught-up", false, "exit once the group has read the topic to where it ended at start")
		run = func() error { return consume(ctx, *topic, *group, *caughtUp) }
	default:
		usage()
	}
	if err := fs.Parse(args); err != nil {
		log.Fatal(err)
	}
	if err := run(); err != nil {
		log.Fatalf("%s: %v", cmd, err)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: orders setup | create-topic | create-orders | relay | consume [flags]\n"+
		"(orders <command> -h lists a command's flags)")
	os.Exit(2)
}

// connect opens a pool of up to size connections to the database.
func connect(ctx context.Context, size int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL")) // "" means: the PG* variables
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(size)
	return pgxpool.NewWithConfig(ctx, cfg)
}

// kafkaClient opens a franz-go client to the brokers, with the options given.
func kafkaClient(opts ...kgo.Opt) (*kgo.Client, error) {
	brokers := os.Getenv("KAFKA_BROKERS")
	if brokers == "" {
		brokers = "localhost:9092"
	}
	return kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(strings.Split(brokers, ",")...)}, opts...)...)
}

// setup makes the example's tables and the relay's outbox consumer. It needs the privileges
// of outbox_admin (to create a consumer) and may run again.
func setup(ctx context.Context) error {
	db, err := connect(ctx, 1)
	if err != nil {
		return err
	}
	defer db.Close()
	if _, err := db.Exec(ctx, schema); err != nil {
		return err
	}
	// A new consumer reads the events committed from now on (from_beginning => true: every
	// event still in the log).
	_, err = db.Exec(ctx, "SELECT outbox.create_consumer($1)", outboxConsumer)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42710" { // duplicate_object: made by an earlier run
		err = nil
	}
	return err
}

// createTopic makes the topic, with the brokers' default replication. Make topics before
// producing to them, on purpose: the partition count fixes which partition each key lands in.
func createTopic(ctx context.Context, topic string, partitions int32) error {
	cl, err := kafkaClient()
	if err != nil {
		return err
	}
	defer cl.Close()
	_, err = kadm.NewClient(cl).CreateTopic(ctx, partitions, -1, nil, topic)
	if errors.Is(err, kerr.TopicAlreadyExists) {
		return nil
	}
	return err
}
