package duality.avro;

import java.io.IOException;
import java.io.InputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Instant;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import org.apache.avro.LogicalType;
import org.apache.avro.Schema;
import org.apache.avro.SchemaCompatibility;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.BinaryDecoder;
import org.apache.avro.io.DecoderFactory;
import org.apache.spark.sql.Column;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.api.java.UDF1;
import org.apache.spark.sql.expressions.UserDefinedFunction;
import org.apache.spark.sql.functions;
import org.apache.spark.sql.types.DataType;

/**
 * Avro records in the Confluent wire format (a magic byte 0, a 4-byte big-endian schema id, the
 * Avro binary record) decoded into a Spark struct of the spec's columns, typed, for the stream's
 * query to check as it checks a parsed JSON record (docs/streams.md#formats, decision 38). The
 * writer schema is fetched by id from the registry's Confluent API ({@code GET /schemas/ids/N})
 * once per JVM and kept; the record is read by Avro's schema resolution into the reader schema,
 * and each column is its reader field's value: a string (an enum's symbol), a long, an int, a
 * double (a float widened), a boolean, or a timestamp (a long of {@code timestamp-millis} or
 * {@code -micros}); null when the field is null.
 *
 * <p>The function gives a struct of {@code p} (the columns, null when bad) and {@code error}
 * (why the record is bad, null when good): no magic byte, a short frame, an unknown schema id,
 * bytes that do not decode, a writer schema incompatible with the reader. When the registry
 * cannot be reached (or answers 5xx) the fetch is retried with backoff, without end: a
 * micro-batch waits for the registry rather than fail or dead-letter good records. An id the
 * registry does not know (404) is a bad record, and is asked again after {@link #UNKNOWN_TTL_MS}.
 */
public final class ConfluentAvro implements UDF1<byte[], Row> {
  private static final long serialVersionUID = 1L;

  static final long UNKNOWN_TTL_MS = 10_000;
  private static final long MAX_BACKOFF_MS = 30_000;
  private static final int TIMEOUT_MS = 10_000;
  // A spec column's type -> its Spark SQL type.
  private static final Map<String, String> SQL_TYPES =
      Map.of(
          "string", "string",
          "long", "bigint",
          "int", "int",
          "double", "double",
          "boolean", "boolean",
          "timestamp", "timestamp");

  // Per JVM (an executor's, or the driver's in local mode): writer schemas by registry and id,
  // ids the registry did not know and when it said so, readers by writer id and reader schema.
  private static final Map<String, Schema> WRITERS = new ConcurrentHashMap<>();
  private static final Map<String, Long> UNKNOWN = new ConcurrentHashMap<>();
  private static final Map<String, Object> READERS = new ConcurrentHashMap<>();

  private final String registry;
  private final String authorization;
  private final String readerText;
  private final String[] names;
  private final String[] kinds;
  // Per task (each task deserializes its own copy of the function): the reader schema, each
  // column's field position and conversion in it, and the record and decoder reused per call.
  private transient Schema reader;
  private transient int[] positions;
  private transient int[] conversions;
  private transient GenericRecord reused;
  private transient BinaryDecoder decoder;

  private static final int STRING = 0;
  private static final int LONG = 1;
  private static final int INT = 2;
  private static final int DOUBLE = 3;
  private static final int BOOLEAN = 4;
  private static final int MILLIS = 5;
  private static final int MICROS = 6;

  ConfluentAvro(String registry, String authorization, String readerSchema, String columns) {
    this.registry = registry.replaceAll("/+$", "");
    this.authorization = authorization;
    this.readerText = readerSchema;
    String[] parts = columns.split(",");
    this.names = new String[parts.length];
    this.kinds = new String[parts.length];
    for (int i = 0; i < parts.length; i++) {
      String[] column = parts[i].split(":", 2);
      if (column.length != 2 || !SQL_TYPES.containsKey(column[1])) {
        throw new IllegalArgumentException("not a column name:type: " + parts[i]);
      }
      names[i] = column[0];
      kinds[i] = column[1];
    }
  }

  /** The function's Spark type: {@code p} (the columns) and {@code error}. */
  DataType resultType() {
    StringBuilder columns = new StringBuilder();
    for (int i = 0; i < names.length; i++) {
      columns.append(i == 0 ? "" : ", ").append('`').append(names[i]).append("`: ");
      columns.append(SQL_TYPES.get(kinds[i]));
    }
    return DataType.fromDDL("p struct<" + columns + ">, error string");
  }

  /**
   * The column decoding {@code value} (binary) into the struct above. {@code columns} are the
   * spec's columns as {@code name:type} separated by commas (types of a spec: string, long, int,
   * double, boolean, timestamp), each a field of the reader schema; {@code authorization} is an
   * HTTP Authorization header's value, or null. Called from Python ({@code duality.avro.frame}).
   */
  public static Column decode(
      Column value, String registry, String authorization, String readerSchema, String columns) {
    ConfluentAvro function = new ConfluentAvro(registry, authorization, readerSchema, columns);
    UserDefinedFunction udf = functions.udf(function, function.resultType());
    return udf.asNonNullable().apply(new Column[] {value});
  }

  private Schema reader() {
    if (reader == null) {
      Schema parsed = new Schema.Parser().parse(readerText);
      int[] at = new int[names.length];
      int[] how = new int[names.length];
      for (int i = 0; i < names.length; i++) {
        Schema.Field field = parsed.getField(names[i]);
        if (field == null) {
          throw new IllegalArgumentException("the reader schema has no field " + names[i]);
        }
        at[i] = field.pos();
        how[i] = conversion(kinds[i], field.schema());
      }
      positions = at;
      conversions = how;
      reader = parsed;
    }
    return reader;
  }

  /** How a column of spec type {@code kind} is read from a field of Avro type {@code avro}. */
  private static int conversion(String kind, Schema avro) {
    if (avro.getType() == Schema.Type.UNION) {
      for (Schema branch : avro.getTypes()) {
        if (branch.getType() != Schema.Type.NULL) {
          avro = branch;
          break;
        }
      }
    }
    switch (kind) {
      case "string":
        return STRING;
      case "long":
        return LONG;
      case "int":
        return INT;
      case "double":
        return DOUBLE;
      case "boolean":
        return BOOLEAN;
      default: // timestamp
        LogicalType logical = avro.getLogicalType();
        boolean micros = logical != null && logical.getName().equals("timestamp-micros");
        return micros ? MICROS : MILLIS;
    }
  }

  @Override
  public Row call(byte[] value) {
    if (value == null) {
      return RowFactory.create(null, null);
    }
    reader();
    if (value.length < 5) {
      return bad("short frame: " + value.length + " bytes, a Confluent frame has at least 5");
    }
    if (value[0] != 0) {
      return bad("no magic byte: the first byte is " + (value[0] & 0xff) + ", not 0");
    }
    int id = ByteBuffer.wrap(value, 1, 4).getInt();
    Schema writer;
    try {
      writer = writer(id);
    } catch (UnknownId e) {
      return bad("unknown schema id " + id);
    }
    Object resolved = resolver(id, writer);
    if (resolved instanceof String) {
      return bad((String) resolved);
    }
    @SuppressWarnings("unchecked")
    GenericDatumReader<GenericRecord> datumReader = (GenericDatumReader<GenericRecord>) resolved;
    Object[] columns = new Object[names.length];
    try {
      decoder = DecoderFactory.get().binaryDecoder(value, 5, value.length - 5, decoder);
      GenericRecord record = datumReader.read(reused, decoder);
      reused = record;
      if (!decoder.isEnd()) {
        return bad("does not decode with schema id " + id + ": bytes after the record");
      }
      for (int i = 0; i < columns.length; i++) {
        columns[i] = column(conversions[i], record.get(positions[i]));
      }
    } catch (IOException | RuntimeException e) {
      // A record the reader failed on mid-way is not reused.
      reused = null;
      return bad("does not decode with schema id " + id + ": " + e);
    }
    return RowFactory.create(RowFactory.create(columns), null);
  }

  /** A reader field's value as its column's. */
  private static Object column(int conversion, Object value) {
    if (value == null) {
      return null;
    }
    switch (conversion) {
      case STRING:
        return value.toString();
      case LONG:
        return ((Number) value).longValue();
      case INT:
        return ((Number) value).intValue();
      case DOUBLE:
        return ((Number) value).doubleValue();
      case BOOLEAN:
        return (Boolean) value;
      case MILLIS:
        return Instant.ofEpochMilli((Long) value);
      default: // MICROS
        long micros = (Long) value;
        return Instant.ofEpochSecond(
            Math.floorDiv(micros, 1_000_000L), Math.floorMod(micros, 1_000_000L) * 1000L);
    }
  }

  private static Row bad(String reason) {
    return RowFactory.create(null, reason);
  }

  /** A reader of writer {@code id} into the reader schema, or why there is none. */
  private Object resolver(int id, Schema writer) {
    String key = registry + "#" + id + "#" + readerText;
    return READERS.computeIfAbsent(
        key,
        k -> {
          SchemaCompatibility.SchemaPairCompatibility check =
              SchemaCompatibility.checkReaderWriterCompatibility(reader(), writer);
          if (check.getType() != SchemaCompatibility.SchemaCompatibilityType.COMPATIBLE) {
            return "writer schema id "
                + id
                + " is incompatible with the reader schema: "
                + check.getResult().getIncompatibilities().stream()
                    .map(i -> i.getMessage() + " at " + i.getLocation())
                    .reduce((a, b) -> a + "; " + b)
                    .orElse(check.getDescription());
          }
          return new GenericDatumReader<GenericRecord>(writer, reader());
        });
  }

  private static final class UnknownId extends Exception {
    private static final long serialVersionUID = 1L;
  }

  /** The writer schema of {@code id}: cached, else fetched, retried with backoff on faults. */
  private Schema writer(int id) throws UnknownId {
    String key = registry + "#" + id;
    Schema known = WRITERS.get(key);
    if (known != null) {
      return known;
    }
    Long since = UNKNOWN.get(key);
    if (since != null && System.currentTimeMillis() - since < UNKNOWN_TTL_MS) {
      throw new UnknownId();
    }
    long backoff = 250;
    while (true) {
      try {
        Schema fetched = fetch(id);
        if (fetched == null) {
          UNKNOWN.put(key, System.currentTimeMillis());
          throw new UnknownId();
        }
        WRITERS.put(key, fetched);
        UNKNOWN.remove(key);
        return fetched;
      } catch (IOException e) {
        System.err.println(
            "duality: schema registry "
                + registry
                + " did not give schema id "
                + id
                + " ("
                + e.getMessage()
                + "); asking again in "
                + backoff
                + " ms");
        try {
          Thread.sleep(backoff);
        } catch (InterruptedException interrupted) {
          Thread.currentThread().interrupt();
          throw new IllegalStateException("interrupted while waiting for the schema registry");
        }
        backoff = Math.min(backoff * 2, MAX_BACKOFF_MS);
      }
    }
  }

  /** Schema {@code id} from the registry; null when it answers 404; IOException on a fault. */
  private Schema fetch(int id) throws IOException {
    HttpURLConnection connection =
        (HttpURLConnection) URI.create(registry + "/schemas/ids/" + id).toURL().openConnection();
    connection.setConnectTimeout(TIMEOUT_MS);
    connection.setReadTimeout(TIMEOUT_MS);
    connection.setRequestProperty("Accept", "application/vnd.schemaregistry.v1+json");
    if (authorization != null) {
      connection.setRequestProperty("Authorization", authorization);
    }
    try {
      int status = connection.getResponseCode();
      if (status == 404) {
        return null;
      }
      if (status != 200) {
        throw new IOException("HTTP " + status);
      }
      String body;
      try (InputStream in = connection.getInputStream()) {
        body = new String(in.readAllBytes(), StandardCharsets.UTF_8);
      }
      com.fasterxml.jackson.databind.JsonNode answer =
          new com.fasterxml.jackson.databind.ObjectMapper().readTree(body);
      com.fasterxml.jackson.databind.JsonNode type = answer.get("schemaType");
      if (type != null && !"AVRO".equals(type.asText())) {
        return null;
      }
      return new Schema.Parser().parse(answer.get("schema").asText());
    } finally {
      connection.disconnect();
    }
  }
}
