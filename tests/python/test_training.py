"""A training loop's smoke test: a tiny torch model on the CPU fed by ImageLoader for one epoch."""
import pytest

import forkguard

torch = pytest.importorskip("torch")


def test_one_epoch_of_training(images):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loader = forkguard.ImageLoader(images, batch_size=8, workers=2, size=32, seed=1)
    loader.set_epoch(0)
    seen, losses = 0, []
    for images_t, labels_t in loader:
        x, y = torch.from_dlpack(images_t), torch.from_dlpack(labels_t)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += len(y)
        losses.append(loss.item())
    assert seen == loader.dataset_size == 24
    assert all(l == l and l < 100 for l in losses)  # finite
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
