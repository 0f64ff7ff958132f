// Debezium's embedded engine with its outbox event router, producing to Kafka as a Connect worker
// (or Debezium Server) would: each record converted with the converters the properties name,
// then a batch sent with acks=all and idempotence, its acks awaited, and only then the batch
// marked processed (its offsets committed). Run by tests/support/debezium.py as a single-file
// program (java -cp 'target/debezium/libs/*' OutboxRouter.java ...); no build step.
//
// Arguments: PROPERTIES BOOTSTRAP TOPIC_PREFIX EXPECT
//   PROPERTIES    the connector's properties (the Kafka guide's, plus where the database is)
//   BOOTSTRAP     the Kafka brokers, host:port,...
//   TOPIC_PREFIX  put before every topic the router picks (so that its records and the native
//                 sink's can be told apart in one cluster); "" for none
//   EXPECT        exit once this many records were produced and acked
// Prints "produced N in S s" (from the first record to the last ack) when done.

import io.debezium.embedded.Connect;
import io.debezium.engine.ChangeEvent;
import io.debezium.engine.DebeziumEngine;
import java.io.FileReader;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;
import org.apache.kafka.connect.storage.Converter;
import org.apache.kafka.connect.storage.HeaderConverter;

public class OutboxRouter {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        try (FileReader reader = new FileReader(args[0])) {
            props.load(reader);
        }
        String bootstrap = args[1];
        String prefix = args[2];
        long expect = Long.parseLong(args[3]);

        Converter keys = (Converter) instance(props, "key.converter");
        keys.configure(prefixed(props, "key.converter."), true);
        Converter values = (Converter) instance(props, "value.converter");
        values.configure(prefixed(props, "value.converter."), false);
        HeaderConverter headers = (HeaderConverter) instance(props, "header.converter");
        headers.configure(prefixed(props, "header.converter."));

        Map<String, Object> producerConfig = new HashMap<>();
        producerConfig.put("bootstrap.servers", bootstrap);
        producerConfig.put("acks", "all");
        producerConfig.put("enable.idempotence", "true");
        producerConfig.put("linger.ms", "5");
        producerConfig.put("key.serializer", ByteArraySerializer.class.getName());
        producerConfig.put("value.serializer", ByteArraySerializer.class.getName());
        KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(producerConfig);

        AtomicLong produced = new AtomicLong();
        AtomicLong firstAt = new AtomicLong();
        CountDownLatch done = new CountDownLatch(1);
        DebeziumEngine<ChangeEvent<SourceRecord, SourceRecord>> engine = DebeziumEngine.create(Connect.class)
            .using(props)
            .notifying((records, committer) -> {
                firstAt.compareAndSet(0, System.nanoTime());
                List<Future<RecordMetadata>> acks = new ArrayList<>();
                for (ChangeEvent<SourceRecord, SourceRecord> event : records) {
                    SourceRecord r = event.value();
                    if (r.topic().startsWith("__debezium-heartbeat")) {
                        continue; // the slot's heartbeat, not an event
                    }
                    RecordHeaders recordHeaders = new RecordHeaders();
                    for (Header h : r.headers()) {
                        recordHeaders.add(h.key(), headers.fromConnectHeader(r.topic(), h.key(), h.schema(), h.value()));
                    }
                    byte[] key = keys.fromConnectData(r.topic(), recordHeaders, r.keySchema(), r.key());
                    byte[] value = values.fromConnectData(r.topic(), recordHeaders, r.valueSchema(), r.value());
                    acks.add(producer.send(new ProducerRecord<>(prefix + r.topic(), null, key, value, recordHeaders)));
                }
                producer.flush();
                for (Future<RecordMetadata> ack : acks) {
                    try {
                        ack.get();
                    } catch (Exception e) {
                        throw new RuntimeException("a record was not acked", e);
                    }
                }
                for (ChangeEvent<SourceRecord, SourceRecord> event : records) {
                    committer.markProcessed(event);
                }
                committer.markBatchFinished();
                if (produced.addAndGet(acks.size()) >= expect) {
                    done.countDown();
                }
            })
            .using((success, message, error) -> {
                if (!success) {
                    System.err.println("engine stopped: " + message);
                    if (error != null) {
                        error.printStackTrace();
                    }
                    System.exit(2);
                }
            })
            .build();
        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        done.await();
        double seconds = (System.nanoTime() - firstAt.get()) / 1e9;
        System.out.printf("produced %d in %.3f s%n", produced.get(), seconds);
        System.out.flush();
        engine.close();
        producer.close();
        executor.shutdown();
        System.exit(0);
    }

    private static Object instance(Properties props, String name) throws Exception {
        return Class.forName(props.getProperty(name)).getDeclaredConstructor().newInstance();
    }

    private static Map<String, Object> prefixed(Properties props, String prefix) {
        Map<String, Object> config = new HashMap<>();
        for (String name : props.stringPropertyNames()) {
            if (name.startsWith(prefix)) {
                config.put(name.substring(prefix.length()), props.getProperty(name));
            }
        }
        return config;
    }
}
