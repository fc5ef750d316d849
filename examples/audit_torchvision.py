"""
Audit a torchvision architecture as a user would: take ResNet-18 (or MobileNetV3-small), train it briefly on CIFAR-10
images, wrap it in ART's ``PyTorchClassifier`` and run the default audit, ``MalleabilityEstimator(classifier)``, with
nothing tuned: the NTK influence chooses its mode and the kernel engine its method from counted work, and the
estimate printed before the audit says how long it will take.

    python examples/audit_torchvision.py --data PATH/cifar10_test_jpeg.npz                 # ResNet-18, 5,000 images
    python examples/audit_torchvision.py --data PATH --arch mobilenet_v3_small --n-train 2000
    python examples/audit_torchvision.py --data PATH --quick                               # smoke run, a minute

``--data`` is any ``.npz`` with arrays ``x`` (uint8 images, ``(n, 32, 32, 3)`` or ``(n, 3, 32, 32)``) and ``y``
(labels), such as the CIFAR-10 test split beside this project. torchvision's models are used as they are (random
initial weights: none can be downloaded here), at 32 x 32 inputs. The script prints the plan, the report, the time
of every phase and the kernel method the engine chose, and writes the report folder (``--output``).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torchvision

from art_malleability import MalleabilityEstimator
from art_malleability.data import load_dataset
from art_malleability.models import make_classifier, train_model

ARCHITECTURES = {
    "resnet18": torchvision.models.resnet18,
    "mobilenet_v3_small": torchvision.models.mobilenet_v3_small,
    "shufflenet_v2": torchvision.models.shufflenet_v2_x0_5,
    "efficientnet_b0": torchvision.models.efficientnet_b0,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="CIFAR-10 .npz (arrays x, y)")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="resnet18")
    parser.add_argument("--n-train", type=int, default=5000, help="training images (all of them are audited)")
    parser.add_argument("--n-test", type=int, default=1000, help="held-out images: the audit's queries")
    parser.add_argument("--epochs", type=int, default=3, help="a brief training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="audit-torchvision")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.n_train, args.n_test, args.epochs = 96, 24, 1

    torch.manual_seed(args.seed)
    data = load_dataset(args.data, n_train=args.n_train, n_test=args.n_test, seed=args.seed)
    model = ARCHITECTURES[args.arch](num_classes=data.nb_classes)
    print(f"{data.name}: {len(data.x_train)} train / {len(data.x_test)} test images; torchvision {args.arch}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    start = time.perf_counter()
    model = train_model(model, data.x_train, data.y_train, epochs=args.epochs, lr=1e-3, weight_decay=5e-4,
                        seed=args.seed, device="cpu", verbose=True)
    trained = time.perf_counter() - start
    classifier = make_classifier(model, data.input_shape, data.nb_classes, device="cpu")

    estimator = MalleabilityEstimator(classifier, seed=args.seed, model_name=args.arch)  # the defaults, nothing tuned
    plan = estimator.estimate(data.x_train, data.x_test)
    print(plan.summary())
    start = time.perf_counter()
    report = estimator.evaluate(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name)
    audited = time.perf_counter() - start
    print()
    print(report.summary())
    execution = report.execution
    method = (execution.get("kernel_method") or {}).get("method", "projected features")
    print(f"\ntrained in {trained:.0f} s; audited in {audited:.0f} s against an estimate of "
          f"{plan.seconds['total']:.0f} s ({plan.seconds['total'] / audited:.2f}x); {execution.get('mode')} NTK "
          f"influence (kernel: {method}, k = {execution.get('projection_dim')})")
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in report.seconds.items()))
    print(f"peak memory (RSS): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    print(f"report in {report.save(args.output)}/")


if __name__ == "__main__":
    main()
