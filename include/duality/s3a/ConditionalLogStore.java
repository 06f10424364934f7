package duality.s3a;

import io.delta.storage.HadoopFileSystemLogStore;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.util.Iterator;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FSDataOutputStreamBuilder;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;

/**
 * Delta's log store for s3a:// tables when several drivers write one table (decision 39): a
 * commit file is created with S3's conditional write (a PUT with If-None-Match: *, through S3A's
 * createFile option fs.option.create.conditional.overwrite, Hadoop 3.4.2), so that of two
 * drivers racing for a version the second is refused by the store itself. Its refusal is
 * Delta's FileAlreadyExistsException: the transaction checks for conflicts and retries at the
 * next version. Delta's own S3SingleDriverLogStore checks for the file, then writes it, which
 * is safe within one JVM only.
 */
public class ConditionalLogStore extends HadoopFileSystemLogStore {
  static final String CONDITIONAL = "fs.option.create.conditional.overwrite";

  public ConditionalLogStore(Configuration hadoopConf) {
    super(hadoopConf);
  }

  @Override
  public void write(Path path, Iterator<String> actions, Boolean overwrite, Configuration conf)
      throws IOException {
    FileSystem fs = path.getFileSystem(conf);
    if (!overwrite && fs.exists(path)) {
      throw new java.nio.file.FileAlreadyExistsException(path.toString());
    }
    FSDataOutputStream out;
    if (overwrite) {
      out = fs.create(path, true);
    } else {
      FSDataOutputStreamBuilder<?, ?> create = fs.createFile(path).overwrite(false);
      create.must(CONDITIONAL, true);
      out = create.build();
    }
    try {
      while (actions.hasNext()) {
        out.write((actions.next() + "\n").getBytes(StandardCharsets.UTF_8));
      }
    } catch (IOException error) {
      out.close();
      throw error;
    }
    try {
      out.close(); // the PUT, which the store refuses (412) when the file was created meanwhile
    } catch (IOException error) {
      if (!overwrite && refused(error)) {
        java.nio.file.FileAlreadyExistsException lost =
            new java.nio.file.FileAlreadyExistsException(path.toString());
        lost.initCause(error);
        throw lost;
      }
      throw error;
    }
  }

  /** Whether S3A's error at close is the store's refusal of the conditional PUT. */
  private static boolean refused(Throwable error) {
    for (Throwable cause = error; cause != null; cause = cause.getCause()) {
      String name = cause.getClass().getName();
      String message = String.valueOf(cause.getMessage());
      if (name.endsWith("FileAlreadyExistsException")
          || name.endsWith("RemoteFileChangedException")
          || message.contains("412")
          || message.contains("PreconditionFailed")) {
        return true;
      }
    }
    return false;
  }

  @Override
  public Boolean isPartialWriteVisible(Path path, Configuration conf) {
    return false; // an S3 object appears whole, or not at all
  }
}
