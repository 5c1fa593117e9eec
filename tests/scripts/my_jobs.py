import time

from pydantic import BaseModel

from tasks import JobContext, JobMetric, job


class Params(BaseModel):
    epochs: int = 10

@job("my_train", params=Params, metrics={"samples_per_s": JobMetric.SAMPLES_PER_S})
def my_train(ctx: JobContext, params: Params) -> dict:
    import torch
    device = torch.device(ctx.torch_device)      # "cpu" or "cuda:0"
    x = torch.randn(1024, 8, device=device)
    y = x @ torch.arange(8.0, device=device)
    model = torch.nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = time.perf_counter()
    for epoch in range(1, params.epochs + 1):    # one epoch: one step over the whole set
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        loss.backward()
        optimizer.step()
        ctx.log(epoch, loss=loss.item())         # the loss curve, for TensorBoard
        ctx.progress(epoch=epoch, epochs=params.epochs, loss=loss.item())
    ctx.artifacts_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), ctx.artifacts_dir / "model.pt")
    seconds = time.perf_counter() - start
    return {"loss": loss.item(), "samples_per_s": params.epochs * len(x) / seconds}
