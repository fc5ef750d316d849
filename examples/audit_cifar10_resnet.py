"""
Audit a ResNet on CIFAR-10: train it, then attack its whole training subset's influential set with ART's
FGSM, PGD and MIM and report the influence flip rate, using the projected NTK influence (a seeded,
Kronecker-factored random projection of every example's logit Jacobians; see docs/scale.md).

    python examples/audit_cifar10_resnet.py --data PATH/cifar10_test_jpeg.npz     # ResNet-20, 5,000 images
    python examples/audit_cifar10_resnet.py --data PATH --quick                   # smoke run, about a minute
    torchrun --standalone --nproc-per-node 2 examples/audit_cifar10_resnet.py --data PATH   # sharded

``--data`` is any ``.npz`` with arrays ``x`` (images) and ``y`` (labels), such as the CIFAR-10 test split
beside this project, or a torchvision CIFAR-10 root folder. The model is the CIFAR ResNet-20 of He et al.
(0.27 M parameters) on a CPU and torchvision's ResNet-18 (3×3 stem, no max pooling) on CUDA, unless ``--arch``
says otherwise. The NTK features are computed in float32 here (``--feature-dtype``): the projection's own
error (a few per cent per kernel entry) is far larger than float32 rounding, and float32 halves the time on a
CPU; the ridge solves stay in float64. The script prints the report, the time of every phase and the peak
memory, and writes the report folder (``--output``).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from art_malleability import MalleabilityEstimator
from art_malleability.data import load_dataset
from art_malleability.distributed import init_from_env
from art_malleability.influence import NTKInfluence
from art_malleability.models import ResNet20, make_classifier, train_model


def resnet18(nb_classes: int) -> torch.nn.Module:
    """torchvision's ResNet-18 for 32×32 images: 3×3 stem without max pooling."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=nb_classes)
    model.conv1 = torch.nn.Conv2d(3, 64, 3, padding=1, bias=False)
    model.maxpool = torch.nn.Identity()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="CIFAR-10 .npz (arrays x, y) or torchvision root folder")
    parser.add_argument("--n-train", type=int, default=5000, help="training images (all of them are audited)")
    parser.add_argument("--n-test", type=int, default=1000, help="held-out images (queries are drawn from them)")
    parser.add_argument("--arch", choices=("auto", "resnet20", "resnet18"), default="auto")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--eps", type=float, default=0.3, help="l-inf budget on [0, 1] pixels (the paper's 0.3)")
    parser.add_argument("--projection-dim", type=int, default=4096)
    parser.add_argument("--feature-dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="audit-cifar10-resnet")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.n_train, args.n_test, args.epochs, args.projection_dim = 200, 50, 1, 256

    shard = init_from_env()  # joins the process group under torchrun, None otherwise
    lead = shard is None or shard.rank == 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    source = args.data if args.data.endswith(".npz") else "cifar10"
    data = load_dataset(source, root=None if source != "cifar10" else args.data, n_train=args.n_train,
                        n_test=args.n_test, seed=args.seed)
    arch = args.arch if args.arch != "auto" else ("resnet18" if device == "cuda" else "resnet20")
    model = resnet18(data.nb_classes) if arch == "resnet18" else ResNet20(data.input_shape, data.nb_classes, args.seed)
    if lead:
        print(f"{data.name}: {len(data.x_train)} train / {len(data.x_test)} test images; {arch}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {device}")
        model = train_model(model, data.x_train, data.y_train, epochs=args.epochs, lr=1e-3, weight_decay=5e-4,
                            seed=args.seed, device=device, verbose=True)
    if shard is not None:  # every process audits the weights trained on rank 0
        model.load_state_dict(shard.broadcast_object({k: v.cpu() for k, v in model.state_dict().items()}))
    trained = time.perf_counter() - start
    classifier = make_classifier(model, data.input_shape, data.nb_classes, device=device)

    influence = NTKInfluence(
        projection_dim=args.projection_dim,
        projection_seed=args.seed,
        dtype=getattr(torch, args.feature_dtype),
        device=device,
        batch_size=64,
        verbose=lead,
    )
    start = time.perf_counter()
    report = MalleabilityEstimator(
        classifier, influence=influence, eps=args.eps, seed=args.seed, device=device,
        verbose=lead, model_name=arch, batch_size=64,
    ).evaluate(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name)
    audited = time.perf_counter() - start
    if not lead:
        return
    report.seconds["train"] = trained
    print()
    print(report.summary())
    print(f"\ntrained in {trained:.0f} s, audited in {audited:.0f} s ({report.execution.get('mode')} NTK influence, "
          f"k = {report.execution.get('projection_dim')}, {report.execution['world_size']} process(es))")
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in report.seconds.items()))
    for r in report.results:
        print(f"  {r.attack}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.seconds.items()))
    print("NTK influence phases (s, cumulative): " + ", ".join(f"{k} {v:.1f}" for k, v in influence.seconds_.items()))
    print(f"peak memory (RSS): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    print(f"report in {report.save(args.output)}/")


if __name__ == "__main__":
    main()
