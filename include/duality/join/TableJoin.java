package duality.join;

import static org.apache.spark.sql.functions.col;
import static org.apache.spark.sql.functions.concat;
import static org.apache.spark.sql.functions.lit;
import static org.apache.spark.sql.functions.when;

import java.util.ArrayList;
import java.util.Comparator;
import java.util.Iterator;
import java.util.List;
import org.apache.spark.api.java.function.FlatMapGroupsWithStateFunction;
import org.apache.spark.sql.Column;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Encoders;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.streaming.GroupState;
import org.apache.spark.sql.streaming.GroupStateTimeout;
import org.apache.spark.sql.streaming.OutputMode;
import org.apache.spark.sql.types.StructType;

/**
 * duality's stream-table join (docs/streams.md#joins, decision 35): per join key, the table's
 * current row is kept in Spark's state store, and the key's records of a micro-batch are replayed
 * in order: by record timestamp, then seeds before table records before events, then partition
 * and offset. A table record replaces the row (a null row deletes it); an event is emitted with
 * the row as it stands. Table records come out too, as they came in (the pipeline's copy of the
 * table is written from them), seeds do not. Events without a join key and bad table records
 * pass through untouched, grouped by partition (every record of a micro-batch goes through
 * this operator, so that the query reads its source once, below its one exchange).
 *
 * <p>Input and output rows have the same columns, in this order: {@code _jk} (string, the join
 * key; null for an event without one), {@code _side} (int: 0 a seed, 1 a table record, 2 an
 * event, 3 a bad table record), {@code _ts} (bigint, milliseconds), {@code _partition} (int),
 * {@code _offset} (bigint), {@code _trow} (the table's row, a struct) and {@code _event} (the
 * record, a struct). Called from Python through the JVM gateway ({@code duality.join.frame});
 * written in Java because a Python stateful operator runs one Python call per key and
 * micro-batch (decision 35 has the figures).
 */
public final class TableJoin implements FlatMapGroupsWithStateFunction<String, Row, Row, Row> {
  private static final long serialVersionUID = 1L;

  static final int SEED = 0;
  static final int EVENT = 2;
  static final int BAD = 3;
  private static final int KEY = 0;
  private static final int SIDE = 1;
  private static final int TS = 2;
  private static final int PARTITION = 3;
  private static final int OFFSET = 4;
  private static final int ROW = 5;
  private static final int THE_EVENT = 6;

  private static final Comparator<Row> ORDER =
      Comparator.comparingLong((Row r) -> r.getLong(TS))
          .thenComparingInt(r -> r.getInt(SIDE))
          .thenComparingInt(r -> r.getInt(PARTITION))
          .thenComparingLong(r -> r.getLong(OFFSET));

  /** The joined rows of {@code input}, whose columns are those above. */
  public static Dataset<Row> apply(Dataset<Row> input) {
    StructType columns = input.schema();
    StructType row = (StructType) columns.apply("_trow").dataType();
    // Grouped by a column, not a function of the row: a function would turn every row into a
    // Java object once more, before the exchange.
    Column passes = col("_jk").isNull().or(col("_side").equalTo(BAD));
    Column group =
        when(passes, concat(lit("p"), col("_partition").cast("string")))
            .otherwise(concat(lit("k"), col("_jk")));
    return input
        .groupBy(group)
        .as(Encoders.STRING(), Encoders.row(columns))
        .flatMapGroupsWithState(
            new TableJoin(),
            OutputMode.Append(),
            Encoders.row(row),
            Encoders.row(columns),
            GroupStateTimeout.NoTimeout());
  }

  /** {@code group}: "k" and a join key, or "p" and a partition for records passing through. */
  @Override
  public Iterator<Row> call(String group, Iterator<Row> records, GroupState<Row> state) {
    if (group.charAt(0) == 'p') {
      return records;
    }
    List<Row> ordered = new ArrayList<>();
    records.forEachRemaining(ordered::add);
    ordered.sort(ORDER);
    Row current = state.exists() ? state.get() : null;
    boolean changed = false;
    List<Row> out = new ArrayList<>();
    for (Row record : ordered) {
      int side = record.getInt(SIDE);
      if (side == EVENT) {
        out.add(
            RowFactory.create(
                record.getString(KEY),
                EVENT,
                record.getLong(TS),
                record.getInt(PARTITION),
                record.getLong(OFFSET),
                current,
                record.get(THE_EVENT)));
        continue;
      }
      current = record.isNullAt(ROW) ? null : record.getStruct(ROW);
      changed = true;
      if (side != SEED) {
        out.add(record);
      }
    }
    if (changed) {
      if (current == null) {
        state.remove();
      } else {
        state.update(current);
      }
    }
    return out.iterator();
  }
}
