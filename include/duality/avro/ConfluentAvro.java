package duality.avro;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonGenerator;
import java.io.IOException;
import java.io.InputStream;
import java.io.StringWriter;
import java.net.HttpURLConnection;
import java.net.URI;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.Base64;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import org.apache.avro.LogicalType;
import org.apache.avro.Schema;
import org.apache.avro.SchemaCompatibility;
import org.apache.avro.generic.GenericData;
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
 * Avro binary record) decoded into JSON text of the reader schema, for a stream's JSON path to
 * parse as it parses a JSON source (docs/streams.md#formats, decision 38). The writer schema is
 * fetched by id from the registry's Confluent API ({@code GET /schemas/ids/N}) once per JVM and
 * kept; the record is read by Avro's schema resolution into the reader schema.
 *
 * <p>The function gives a struct of {@code json} (the record's JSON text, null when bad) and
 * {@code error} (why the record is bad, null when good): no magic byte, a short frame, an unknown
 * schema id, bytes that do not decode, a writer schema incompatible with the reader. When the
 * registry cannot be reached (or answers 5xx) the fetch is retried with backoff, without end: a
 * micro-batch waits for the registry rather than fail or dead-letter good records. An id the
 * registry does not know (404) is a bad record, and is asked again after {@link #UNKNOWN_TTL_MS}.
 */
public final class ConfluentAvro implements UDF1<byte[], Row> {
  private static final long serialVersionUID = 1L;

  static final DataType RESULT = DataType.fromDDL("json string, error string");
  static final long UNKNOWN_TTL_MS = 10_000;
  private static final long MAX_BACKOFF_MS = 30_000;
  private static final int TIMEOUT_MS = 10_000;

  // Per JVM (an executor's, or the driver's in local mode): writer schemas by registry and id,
  // ids the registry did not know and when it said so, readers by writer id and reader schema.
  private static final Map<String, Schema> WRITERS = new ConcurrentHashMap<>();
  private static final Map<String, Long> UNKNOWN = new ConcurrentHashMap<>();
  private static final Map<String, Object> READERS = new ConcurrentHashMap<>();
  private static final JsonFactory JSON = new JsonFactory();
  private static final DateTimeFormatter MILLIS =
      DateTimeFormatter.ofPattern("yyyy-MM-dd'T'HH:mm:ss.SSS'Z'").withZone(ZoneOffset.UTC);
  private static final DateTimeFormatter MICROS =
      DateTimeFormatter.ofPattern("yyyy-MM-dd'T'HH:mm:ss.SSSSSS'Z'").withZone(ZoneOffset.UTC);

  private final String registry;
  private final String authorization;
  private final String readerText;
  private transient Schema reader;

  ConfluentAvro(String registry, String authorization, String readerSchema) {
    this.registry = registry.replaceAll("/+$", "");
    this.authorization = authorization;
    this.readerText = readerSchema;
  }

  /**
   * The column decoding {@code value} (binary) into the struct above. {@code authorization} is
   * an HTTP Authorization header's value, or null; called from Python ({@code
   * duality.avro.frame}).
   */
  public static Column decode(
      Column value, String registry, String authorization, String readerSchema) {
    UserDefinedFunction udf =
        functions.udf(new ConfluentAvro(registry, authorization, readerSchema), RESULT);
    return udf.asNonNullable().apply(new Column[] {value});
  }

  private Schema reader() {
    if (reader == null) {
      reader = new Schema.Parser().parse(readerText);
    }
    return reader;
  }

  @Override
  public Row call(byte[] value) {
    if (value == null) {
      return RowFactory.create(null, null);
    }
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
    GenericRecord record;
    try {
      BinaryDecoder decoder = DecoderFactory.get().binaryDecoder(value, 5, value.length - 5, null);
      record = datumReader.read(null, decoder);
      if (!decoder.isEnd()) {
        return bad("does not decode with schema id " + id + ": bytes after the record");
      }
    } catch (IOException | RuntimeException e) {
      return bad("does not decode with schema id " + id + ": " + e);
    }
    try {
      return RowFactory.create(json(record), null);
    } catch (IOException | RuntimeException e) {
      return bad("does not decode with schema id " + id + ": " + e);
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

  // -- the record as JSON --------------------------------------------------------------------

  static String json(GenericRecord record) throws IOException {
    StringWriter out = new StringWriter();
    try (JsonGenerator generator = JSON.createGenerator(out)) {
      write(generator, record.getSchema(), record);
    }
    return out.toString();
  }

  private static void write(JsonGenerator out, Schema schema, Object value) throws IOException {
    if (schema.getType() == Schema.Type.UNION) {
      schema = schema.getTypes().get(GenericData.get().resolveUnion(schema, value));
    }
    LogicalType logical = schema.getLogicalType();
    switch (schema.getType()) {
      case NULL:
        out.writeNull();
        return;
      case BOOLEAN:
        out.writeBoolean((Boolean) value);
        return;
      case INT:
        out.writeNumber((Integer) value);
        return;
      case LONG:
        long number = (Long) value;
        if (logical != null && logical.getName().equals("timestamp-millis")) {
          out.writeString(MILLIS.format(Instant.ofEpochMilli(number)));
        } else if (logical != null && logical.getName().equals("timestamp-micros")) {
          out.writeString(
              MICROS.format(
                  Instant.ofEpochSecond(
                      Math.floorDiv(number, 1_000_000L),
                      Math.floorMod(number, 1_000_000L) * 1000L)));
        } else {
          out.writeNumber(number);
        }
        return;
      case FLOAT:
        out.writeNumber((Float) value);
        return;
      case DOUBLE:
        out.writeNumber((Double) value);
        return;
      case STRING:
      case ENUM:
        out.writeString(value.toString());
        return;
      case BYTES:
        ByteBuffer buffer = ((ByteBuffer) value).duplicate();
        byte[] bytes = new byte[buffer.remaining()];
        buffer.get(bytes);
        out.writeString(Base64.getEncoder().encodeToString(bytes));
        return;
      case FIXED:
        out.writeString(Base64.getEncoder().encodeToString(((GenericData.Fixed) value).bytes()));
        return;
      case ARRAY:
        out.writeStartArray();
        for (Object item : (java.util.Collection<?>) value) {
          write(out, schema.getElementType(), item);
        }
        out.writeEndArray();
        return;
      case MAP:
        out.writeStartObject();
        for (Map.Entry<?, ?> entry : ((Map<?, ?>) value).entrySet()) {
          out.writeFieldName(entry.getKey().toString());
          write(out, schema.getValueType(), entry.getValue());
        }
        out.writeEndObject();
        return;
      case RECORD:
        GenericRecord record = (GenericRecord) value;
        out.writeStartObject();
        for (Schema.Field field : schema.getFields()) {
          out.writeFieldName(field.name());
          write(out, field.schema(), record.get(field.pos()));
        }
        out.writeEndObject();
        return;
      default:
        throw new IOException("no JSON for Avro type " + schema.getType());
    }
  }
}
