"""A Flax MLP as a dynax block, trained inside dynamic graphs.

Task: a bag of 3, 5 or 7 points in the plane; is the majority of them inside the unit circle?
Each point is encoded by a Flax (linen) MLP, the encodings of a bag are averaged with
``dx.average`` (bags have different sizes, so every instance has its own graph), and a dynax
affine layer classifies the average. ``dx.nn.from_flax`` puts the MLP's weights in the same
``ParameterCollection`` as the dynax weights, so one Adam trainer updates both, and all the
MLP calls of a minibatch run as one batched kernel.

Run: ``python examples/flax_block.py`` (under 30 s on a busy 2-core CPU, mostly compiling).
"""
import flax.linen as nn
import jax
import numpy as np

import dynax as dx


class PointEncoder(nn.Module):
    """One point (shape ``(2,)``, no batch dimension) -> an 8-dim code."""

    @nn.compact
    def __call__(self, p):
        return nn.tanh(nn.Dense(8)(nn.tanh(nn.Dense(16)(p))))


def make_bags(rng, n):
    bags, labels = [], []
    for _ in range(n):
        # half the square [-1.25, 1.25]^2 lies inside the circle: balanced classes
        pts = rng.uniform(-1.25, 1.25, size=(rng.choice([3, 5, 7]), 2)).astype(np.float32)
        inside = (pts ** 2).sum(1) < 1.0
        bags.append(pts)
        labels.append(int(inside.sum() * 2 > len(pts)))
    return bags, labels


def main(epochs=12, batch=64):
    rng = np.random.default_rng(0)
    train, test = make_bags(rng, 384), make_bags(rng, 256)

    pc = dx.ParameterCollection(seed=0)
    encoder = dx.nn.from_flax(PointEncoder(), pc, np.zeros(2, np.float32))
    W = pc.add_parameters((2, 8), name="W")
    b = pc.add_parameters((2,), init="zeros", name="b")
    trainer = dx.AdamTrainer(pc, alpha=0.05)

    def logits(points):
        return dx.affine_transform([b, W, dx.average([encoder(dx.input(p)) for p in points])])

    def accuracy(bags, labels):
        correct = 0
        for start in range(0, len(bags), batch):  # minibatches: the training kernels serve
            dx.renew_cg(train=False)
            outs = [logits(bag) for bag in bags[start:start + batch]]
            dx.forward(outs)
            correct += sum(int(np.argmax(o.npvalue())) == y
                           for o, y in zip(outs, labels[start:start + batch]))
        return correct / len(bags)

    print(f"parameters: {[p.name for p in pc.parameters()]}")
    print(f"test accuracy before training: {accuracy(*test):.3f} "
          f"(majority class: {max(np.mean(test[1]), 1 - np.mean(test[1])):.3f})")
    for epoch in range(epochs):
        order, total = rng.permutation(len(train[0])), 0.0
        for start in range(0, len(order), batch):
            cg = dx.renew_cg()
            loss = dx.esum([dx.pickneglogsoftmax(logits(train[0][i]), train[1][i])
                            for i in order[start:start + batch]])
            total += loss.scalar_value()
            loss.backward()
            trainer.update()
        if epoch % 3 == 0 or epoch == epochs - 1:
            stats = cg.stats()
            print(f"epoch {epoch + 1:2d}: train loss {total / len(order):.3f}, test accuracy "
                  f"{accuracy(*test):.3f}  (last graph: {stats['nodes']} nodes in "
                  f"{stats['batches']} batched kernels)")

    # What the Flax encoder learned, read back in Flax's own layout: the class-1 score of a
    # bag holding one point, along a ray from the centre outwards (it should fall near r = 1).
    radii = np.array([0.0, 0.5, 0.9, 1.1, 1.5], np.float32)
    points = np.stack([radii, np.zeros_like(radii)], axis=1)
    codes = jax.vmap(lambda p: PointEncoder().apply({"params": encoder.flax_params()}, p))(points)
    z = np.asarray(codes) @ np.asarray(W.value).T + np.asarray(b.value)
    p_inside = np.exp(z[:, 1]) / np.exp(z).sum(axis=1)
    print("P(inside) of a one-point bag at radius r: "
          + ", ".join(f"r={r:.1f}: {p:.2f}" for r, p in zip(radii, p_inside)))


if __name__ == "__main__":
    main()
