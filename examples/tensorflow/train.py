"""TensorFlow MultiWorkerMirroredStrategy on CPU, driven only by TF_CONFIG (seed 001 §1.4).

Each worker trains a tiny MLP on its own shard of a synthetic regression problem; the strategy all-reduces
the gradients, so every worker ends with the same weights. The last line printed (by every worker) is
``final_params_sha256=<hex>``: the tests compare it across workers.

Keras 3's ``model.fit`` fails under MultiWorkerMirroredStrategy (``Attempt to convert a value
(PerReplica...)``, keras-team/keras#20585), so this is the custom loop TensorFlow documents: ``strategy.run``
inside a ``tf.function``, the loss scaled by the global batch size, Keras layers and optimizer.
"""

import argparse
import hashlib
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TF loads: keep the log to what matters

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402


def weights_sha256(model: keras.Model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    # Azure ML (or azulite) sets TF_CONFIG: the cluster's worker list and this process's task
    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    task = tf_config.get("task", {"type": "worker", "index": 0})
    print(f"tf_config={json.dumps(tf_config, sort_keys=True)}", flush=True)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    print(f"worker {task['index']} replicas_in_sync {replicas} pid {os.getpid()}", flush=True)

    keras.utils.set_random_seed(0)  # same initial weights on every worker
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(learning_rate=args.lr)
    global_batch = args.batch_size * replicas

    @tf.function
    def train_step(x, y):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_sum(tf.square(model(x, training=True) - y), axis=-1)
                # gradients are summed across replicas: average over the GLOBAL batch
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step_fn, args=(x, y)), axis=None)

    true_w = np.random.default_rng(1).standard_normal((16, 1)).astype(np.float32)
    data = np.random.default_rng(100 + int(task["index"]))  # each worker its own data shard
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = data.standard_normal((args.batch_size, 16)).astype(np.float32)
        loss = train_step(tf.constant(x), tf.constant(x @ true_w))
        if task["index"] == 0:
            print(f"step {step} loss {float(loss):.5f} step_s {time.perf_counter() - t0:.5f}", flush=True)

    print(f"final_params_sha256={weights_sha256(model)}", flush=True)


if __name__ == "__main__":
    main()
