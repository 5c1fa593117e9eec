import torch
from pydantic import BaseModel

from tasks import DeviceData, JobContext, job, place_data


class FitParams(BaseModel):
    epochs: int = 5
    batch_size: int = 64
    seed: int = 0

@job("my_fit", params=FitParams)
def my_fit(ctx: JobContext, params: FitParams) -> dict:
    torch.manual_seed(params.seed)
    x = torch.randn(4096, 16)                    # your dataset, loaded on the CPU
    y = (x[:, 0] > 0).long()
    placement = place_data(ctx, x, y)            # fits the job's memory budget?
    model = torch.nn.Linear(16, 2).to(ctx.torch_device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if placement.on_device:                      # copied to the device once
        data = DeviceData.from_tensors(x, y, device=ctx.torch_device)
        epochs = (data.batches(params.batch_size, data.generator(params.seed + e))
                  for e in range(params.epochs))
    else:                                        # too big: a DataLoader feeds it
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                             batch_size=params.batch_size, shuffle=True)
        epochs = (iter(loader) for _ in range(params.epochs))
    for epoch, batches in enumerate(epochs, 1):
        for xb, yb in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(xb.to(ctx.torch_device)), yb.to(ctx.torch_device))
            loss.backward()
            optimizer.step()
        ctx.progress(epoch=epoch, epochs=params.epochs)
    return {"loss": loss.item(), "data_path": placement.path, "why": placement.note}
