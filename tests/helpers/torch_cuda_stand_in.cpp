// A library named libtorch_cuda.so with nothing in it: what a CUDA build of torch maps, for the
// doctor's "fork safety unknown" from another process (torch's own fork poison cannot be seen
// there) without torch.
extern "C" int forkguard_torch_cuda_stand_in() {
  return 0;
}
